"""The learner checks each rollout server's repeat guard (issue 12 item 6, spec 004: fail fast when the config
requires the guard and a server runs without it). Real ``coordexp serve-rollout`` processes with the guard on and
off; stubs for a server without the endpoint (``swift rollout``) and for malformed answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.errors import EXIT_EXTERNAL, exit_code_for
from coordexp.runtime.rollout.client import RolloutServerClient
from coordexp.runtime.rollout.repeat_guard_check import (
    RepeatGuardInactiveError,
    check_repeat_guards,
    probe_repeat_guard,
)
from coordexp.runtime.rollout.vllm_server import VllmServerBackend
from coordexp.runtime.train.preflight import run_preflight
from coordexp.schema.contract import load_contract
from coordexp.schema.rollout import RepeatTerminateConfig

from testkit import ServeRolloutProcess, free_port, server_rollout, stub_server

GUARD = {"enabled": True, "min_new_tokens": 8, "max_consecutive_token_repeats": 16, "ngram_size": 8,
         "ngram_repeats": 3, "max_object_keys": 20}
NOT_FOUND = (404, {"detail": "Not Found"})  # what FastAPI (swift rollout) answers for an unknown path


def learner_config(write_config, base_url: str, *, guard: bool, name: str = "learner.yaml") -> Path:
    return write_config({"rollout_matching": {**server_rollout([(base_url, free_port())]),
                                              "repeat_terminate": {**GUARD, "enabled": guard}}}, name=name)


def build_backend(config: Path) -> VllmServerBackend:
    return VllmServerBackend.from_run(load_contract(config), None, None)


# -- stubs: no endpoint, malformed answers, inactive ------------------------------------------------------------
def test_a_server_without_the_endpoint_is_reported_as_unchecked(write_config, stub):
    stub.behaviour["/coordexp/repeat_guard/"] = lambda handler, body: NOT_FOUND
    backend = build_backend(learner_config(write_config, stub.base_url, guard=True))
    try:
        (probe,) = backend.run_metadata()["repeat_guard"]
    finally:
        backend.close()
    assert probe["state"] == "unknown" and "cannot be checked" in probe["detail"]
    report = run_preflight(learner_config(write_config, stub.base_url, guard=True), health_timeout_s=5)
    (check,) = [c for c in report.checks if c.name.startswith("repeat guard")]
    assert check.ok and "cannot be checked" in check.detail and "swift rollout" in check.detail


def test_a_stub_that_says_inactive_fails_fast_with_exit_3(write_config, stub):
    stub.behaviour["/coordexp/repeat_guard/"] = lambda handler, body: (200, {"active": False, "repeat_terminate": {}})
    with pytest.raises(RepeatGuardInactiveError, match=stub.base_url) as info:
        build_backend(learner_config(write_config, stub.base_url, guard=True))
    assert exit_code_for(info.value) == EXIT_EXTERNAL
    assert "repeat_terminate.enabled" in info.value.hint


def test_nothing_is_asked_when_the_config_does_not_need_the_guard(write_config, stub):
    backend = build_backend(learner_config(write_config, stub.base_url, guard=False))
    backend.close()
    assert not [c for c in stub.calls if c[1] == "/coordexp/repeat_guard/"]
    assert backend.run_metadata()["repeat_guard"] == []


def test_every_inactive_server_is_named_once():
    with stub_server() as a, stub_server() as b, stub_server() as c:
        for s in (a, c):
            s.behaviour["/coordexp/repeat_guard/"] = lambda handler, body: (200, {"active": False})
        b.behaviour["/coordexp/repeat_guard/"] = lambda handler, body: NOT_FOUND
        clients = [RolloutServerClient(s.base_url, timeout_s=5) for s in (a, b, c)]
        with pytest.raises(RepeatGuardInactiveError) as info:
            check_repeat_guards(clients, RepeatTerminateConfig(**GUARD))
    message = str(info.value)
    assert a.base_url in message and c.base_url in message and b.base_url not in message


class AnsweringClient:
    """A client double whose ``GET /coordexp/repeat_guard/`` returns ``body``."""

    base_url = "http://guard"
    timeout_s = 1.0

    def __init__(self, body):
        self.body = body

    def url(self, endpoint: str) -> str:
        return f"{self.base_url}/{endpoint}/"

    def request(self, method, endpoint, payload=None, *, timeout):
        return self.body


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(body=json_values | st.fixed_dictionaries({"active": st.booleans()},
                                                optional={"repeat_terminate": st.dictionaries(
                                                    st.sampled_from(sorted(GUARD)), json_values, max_size=6)}))
def test_any_answer_is_classified_never_a_crash(body):
    probe = probe_repeat_guard(AnsweringClient(body), RepeatTerminateConfig(**GUARD))
    if isinstance(body, dict) and isinstance(body.get("active"), bool):
        assert probe.state == ("active" if body["active"] else "inactive")
        served = body.get("repeat_terminate") or {}
        # exactly the settings the server states differently are reported
        assert len(probe.differences) == (sum(served[k] != v for k, v in GUARD.items() if k in served)
                                          if body["active"] else 0)
    else:
        assert probe.state == "unknown"


# -- real coordexp serve-rollout processes ----------------------------------------------------------------------
@pytest.fixture()
def guarded_and_unguarded(tmp_path, write_config):
    """Two real servers from the same config but for repeat_terminate.enabled: (on, off)."""
    servers = [ServeRolloutProcess(write_config({"rollout_matching": {"repeat_terminate": {**GUARD, "enabled": on}}},
                                         name=f"server_{on}.yaml"), tmp_path / f"server_{on}.log")
               for on in (True, False)]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.mark.slow
def test_real_servers_with_the_guard_on_and_off(write_config, guarded_and_unguarded):
    on, off = guarded_and_unguarded
    body = RolloutServerClient(on.base_url, timeout_s=5).request("GET", "coordexp/repeat_guard", timeout=5)
    assert body == {"active": True, "repeat_terminate": GUARD}
    # the guard is on: the learner starts and records the check in its metadata
    backend = build_backend(learner_config(write_config, on.base_url, guard=True))
    backend.close()
    assert [p["state"] for p in backend.run_metadata()["repeat_guard"]] == ["active"]
    # the guard is off but the config requires it: fail fast, naming the server and the fix
    with pytest.raises(RepeatGuardInactiveError, match=off.base_url.replace(".", r"\.")):
        build_backend(learner_config(write_config, off.base_url, guard=True, name="learner_off.yaml"))
    # a config without the guard does not care
    build_backend(learner_config(write_config, off.base_url, guard=False, name="learner_free.yaml")).close()
    # preflight reports the same, exit 3 for the unguarded server
    good = run_preflight(learner_config(write_config, on.base_url, guard=True, name="pre_on.yaml"), health_timeout_s=10)
    bad = run_preflight(learner_config(write_config, off.base_url, guard=True, name="pre_off.yaml"), health_timeout_s=10)
    assert good.ok, good.problems
    assert bad.exit_code == EXIT_EXTERNAL
    assert [c.name for c in bad.problems] == [f"repeat guard {off.base_url}"]

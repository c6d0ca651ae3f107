"""The CLI frame: every deliberate error class exits with its family's code and no traceback; bugs exit 1 with the
debug hint; ``--json`` errors are JSON; ``coordexp train`` against a dead server exits 3 and an oversized packing
segment exits 2, each naming the fix."""

from __future__ import annotations

import json
import sys

import pytest
import typer
from typer.testing import CliRunner

from coordexp.cli import frame
from coordexp.cli.app import app
from testkit import free_port, server_rollout

runner = CliRunner()


def _config_error():
    from coordexp.schema.errors import ConfigError, ConfigIssue

    return ConfigError([ConfigIssue("training.max_steps", "must be > 0", "Set a positive step count")])


def _rule_error():
    from coordexp.schema.errors import ConfigRuleError, RuleViolation

    return ConfigRuleError([RuleViolation("packing_buffer", "too small", "Raise it")])


def _make(module: str, name: str, *args, **kwargs):
    def build():
        import importlib

        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    build.__name__ = name
    return build


URL = "http://127.0.0.1:9/infer/"
# (how to build the error, the exit code the issue assigns to its concern) - written out here, not read from the
# classes, so a class that loses its family fails this table.
CASES = [
    (_config_error, 2),
    (_rule_error, 2),
    (_make("coordexp.schema.yaml_io", "YamlReadError", "duplicate key 'a'", "Remove one of them"), 2),
    (_make("coordexp.runtime.model.data", "DatasetError", ["train.jsonl:3: objects[0].bbox_2d: 4 numbers"]), 2),
    (_make("coordexp.runtime.model.encoding", "EncodingError", "r.jsonl:1: 2 image pads for 1 image"), 2),
    (_make("coordexp.runtime.model.mrope", "PackingError", "model_type 'llama' cannot be packed"), 2),
    (_make("coordexp.runtime.model.policy", "LaunchError", "model.path ./nope does not exist"), 2),
    (_make("coordexp.runtime.core.packing", "PackingLimitError", "encoded_len=90 > packing_length=32"), 2),
    (_make("coordexp.runtime.server.serve", "ServeInputError", "--port 70000 is not a TCP port"), 2),
    (_make("coordexp.runtime.server.serve", "ServeSystemError", "port 8000 on 127.0.0.1 is already in use"), 3),
    (_make("coordexp.runtime.core.distribution", "InfeasibleTopologyError", "decode_batch_size 1 * S 1 < W 4"), 3),
    (_make("coordexp.runtime.rollout.client", "ServerError", "server failed", url=URL), 3),
    (_make("coordexp.runtime.rollout.client", "ServerUnreachableError", "connection refused", url=URL), 3),
    (_make("coordexp.runtime.rollout.client", "ServerTimeoutError", "no answer in 5 s", url=URL), 3),
    (_make("coordexp.runtime.rollout.client", "ServerResponseError", "HTTP 500", url=URL), 3),
    (_make("coordexp.runtime.rollout.vllm_server", "RolloutServerError", "server failed twice"), 3),
    (_make("coordexp.runtime.rollout.weight_sync", "WeightSyncError", "the push timed out"), 3),
    (_make("coordexp.runtime.rollout.weight_sync", "WeightSyncTimeout", "no ack in 30 s"), 3),
    (_make("coordexp.runtime.rollout.weight_sync", "RemoteApplyError", "unknown weight not.a.weight", {1: "x"}), 3),
    (_make("coordexp.runtime.rollout.base", "BackendUnavailableError", "backend missing"), 3),
    (_make("coordexp.runtime.rollout.vllm_import", "VllmUnavailableError", "vllm is not installed"), 3),
    (_make("coordexp.runtime.rollout.offload", "OffloadError", "ZeRO-3 owns its storage"), 3),
    (_make("coordexp.runtime.server.engine", "EngineError", "no LoRA support"), 3),
    (_make("coordexp.integrations.swift_plugin", "PluginError", "ms-swift is not installed"), 3),
    (_make("coordexp.errors", "MissingDependencyError", "binpacking is missing", hint="pip install binpacking"), 3),
    (_make("builtins", "RuntimeError", "simulated bug"), 1),
    (_make("builtins", "KeyError", "simulated bug"), 1),
]


def _app_raising(exc: BaseException) -> typer.Typer:
    """A one-command app whose command raises ``exc`` inside the frame's guarded runner, like every real one."""
    test_app = typer.Typer()

    def boom(as_json: bool = typer.Option(False, "--json")) -> None:
        raise exc

    test_app.command("boom")(frame.guarded(boom))
    test_app.command("other")(lambda: None)  # two commands: "boom" is a subcommand, as in the real CLI
    return test_app


def _app_failing() -> typer.Typer:
    """A one-command app whose command calls ``frame.fail``."""
    test_app = typer.Typer()
    test_app.command("boom")(frame.guarded(lambda: frame.fail("no checkpoint here", "Pass one")))
    test_app.command("other")(lambda: None)
    return test_app


@pytest.mark.parametrize(("build", "code"), CASES, ids=[b.__name__ for b, _ in CASES])
def test_each_error_class_exits_with_its_code_and_no_traceback(build, code, monkeypatch):
    monkeypatch.delenv("COORDEXP_DEBUG", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    exc = build()
    result = runner.invoke(_app_raising(exc), ["boom"], catch_exceptions=False)
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    message = exc.problems[0] if hasattr(exc, "problems") else str(exc).splitlines()[0]
    assert message.split(":")[0] in result.stderr
    if code == 1:
        assert "internal error" in result.stderr and "bug in coordexp" in result.stderr
        assert "COORDEXP_DEBUG=1" in result.stderr
    else:
        assert "bug in coordexp" not in result.stderr and result.stderr.startswith("✗ ")
        assert getattr(exc, "hint", "") in result.stderr


@pytest.mark.parametrize(("build", "code"), [CASES[0], CASES[11], CASES[-1]], ids=["config", "server", "bug"])
def test_json_errors_are_one_object_on_stdout(build, code, monkeypatch):
    monkeypatch.delenv("COORDEXP_DEBUG", raising=False)
    result = runner.invoke(_app_raising(build()), ["boom", "--json"], catch_exceptions=False)
    assert result.exit_code == code
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["exit_code"] == code
    assert payload["error"]["kind"] == {1: "internal", 2: "user_input", 3: "external_system"}[code]
    if code == 2:
        assert payload["error"]["issues"][0]["path"] == "training.max_steps"


def test_debug_env_adds_the_traceback_and_keeps_the_code(monkeypatch):
    monkeypatch.setenv("COORDEXP_DEBUG", "1")
    for build, code in (CASES[6], CASES[-1]):
        result = runner.invoke(_app_raising(build()), ["boom"], catch_exceptions=False)
        assert result.exit_code == code and "Traceback (most recent call last)" in result.stderr


def test_interrupt_exits_130(monkeypatch):
    result = runner.invoke(_app_raising(KeyboardInterrupt()), ["boom"], catch_exceptions=False)
    assert result.exit_code == 130 and "interrupted" in result.stderr


def test_other_ranks_say_their_user_errors_in_one_line_and_report_bugs_in_full(monkeypatch, write_config):
    """A rank's reason may be its own (a file its node lacks, issue 55): every rank says it, rank 0 in full."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("COORDEXP_DEBUG", raising=False)
    short = runner.invoke(_app_raising(CASES[6][0]()), ["boom"], catch_exceptions=False)
    assert short.exit_code == 2 and short.stderr.startswith("[rank 1] ✗ ") and short.stderr.count("\n") == 1
    failed = runner.invoke(_app_failing(), ["boom"], catch_exceptions=False)
    assert failed.exit_code == 2 and failed.stderr == "[rank 1] ✗ no checkpoint here. Pass one\n"
    # a config that does not validate: one line naming the first problem (rank 0 lists them all)
    invalid = runner.invoke(app, ["train", str(write_config({"rollout_matching": {"decode_batch_size": -3}}))],
                            catch_exceptions=False)
    assert invalid.exit_code == 2 and invalid.stderr.count("\n") == 1, invalid.stderr
    assert invalid.stderr.startswith("[rank 1] ✗ ") and "problem(s), the first: rollout_matching." in invalid.stderr
    bug = runner.invoke(_app_raising(RuntimeError("rank-local bug")), ["boom"], catch_exceptions=False)
    assert bug.exit_code == 1 and "[rank 1]" in bug.stderr and "rank-local bug" in bug.stderr


def test_missing_binpacking_is_an_external_error_with_the_pip_fix(monkeypatch):
    """The real failure, not a constructed one: the carry buffer cannot be built without ``binpacking``."""
    from coordexp.runtime.core.packing import CarryBuffer

    monkeypatch.setitem(sys.modules, "binpacking", None)  # `import binpacking` now raises ImportError
    monkeypatch.delenv("COORDEXP_DEBUG", raising=False)

    test_app = typer.Typer()
    test_app.command("boom")(frame.guarded(lambda: CarryBuffer(packing_length=32, max_segments=4)))
    test_app.command("other")(lambda: None)
    result = runner.invoke(test_app, ["boom"], catch_exceptions=False)
    assert result.exit_code == 3 and "pip install binpacking" in result.stderr
    with pytest.raises(ImportError):  # the historical base still catches it
        CarryBuffer(packing_length=32, max_segments=4)


# -- real runs ------------------------------------------------------------------------------------------------


def test_train_against_a_dead_server_exits_3_with_the_url_and_the_fix(write_config):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = write_config({"rollout_matching": server_rollout([(url, free_port())], server={"timeout_s": 1.0}),
                        "training": {"max_steps": 1}})
    result = runner.invoke(app, ["train", str(cfg)], catch_exceptions=False)
    assert result.exit_code == 3, result.output
    assert url in result.stderr
    assert "start the server first" in result.stderr  # the fix (client.SERVER_MODE_HINT)
    assert "bug in coordexp" not in result.output and "Traceback" not in result.output


def test_an_oversized_packing_segment_exits_2_with_its_mitigations(write_config):
    cfg = write_config({"global_max_length": 32, "training": {"packing": True, "max_steps": 1},
                        "rollout_matching": {"max_new_tokens": 8}})
    result = runner.invoke(app, ["train", str(cfg)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    text = " ".join(result.stderr.split())
    assert "packing_length=32" in text and "global_max_length" in text and "training.packing: false" in text
    assert "bug in coordexp" not in result.output and "Traceback" not in result.output


def test_usage_errors_and_exits_pass_through_the_frame():
    """typer's own exits keep their codes: a BadParameter raised in a command is a usage error (2), not a bug."""
    result = runner.invoke(_app_raising(typer.BadParameter("--limit must be positive")), ["boom"])
    assert result.exit_code == 2 and "--limit must be positive" in result.output and "bug" not in result.output
    assert runner.invoke(_app_raising(typer.Exit(7)), ["boom"]).exit_code == 7


def test_an_invalid_run_with_json_reports_every_problem_as_json_before_loading(write_yaml, stage2_config):
    stage2_config["training"]["max_stepz"] = 3
    stage2_config["rollout_matching"]["decode_batch_size"] = 0
    result = runner.invoke(app, ["train", str(write_yaml(stage2_config)), "--json"], catch_exceptions=False)
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["ok"] is False and payload["exit_code"] == 2
    paths = {e["path"] for e in payload["errors"]}
    assert {"training.max_stepz", "rollout_matching.decode_batch_size"} <= paths
    assert "Nothing was loaded" in result.stderr

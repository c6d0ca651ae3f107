"""Does each rollout server run the repeat guard the learner's config requires? (docs/design.md, repeat guard: fail fast.)

Wire: ``GET /coordexp/repeat_guard/`` is a coordexp extension of the ms-swift protocol; ``coordexp serve-rollout``
answers :func:`repeat_guard_reply` (``{"active": bool, "repeat_terminate": {...the server's subtree...}}``). A
``swift rollout`` server has no such endpoint (404), so its guard cannot be checked from the learner: the check
reports ``unknown`` and says so (the plugin must be loaded with ``--external_plugins``); it never guesses.

Decision: a server that answers ``active: false`` while the learner's ``rollout_matching.repeat_terminate.enabled``
is true raises :class:`RepeatGuardInactiveError`, an :class:`~coordexp.errors.ExternalSystemError` (exit 3, like
every other server that is up but not as the run needs it); the fix is to restart that server from a config with
the guard on. Differences in the guard's thresholds are reported, not fatal.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence

from coordexp.errors import ExternalSystemError
from coordexp.runtime.rollout.client import ServerError, is_not_found

if TYPE_CHECKING:
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.schema.rollout import RepeatTerminateConfig

__all__ = ["REPEAT_GUARD_ENDPOINT", "RepeatGuardInactiveError", "RepeatGuardProbe", "repeat_guard_reply",
           "probe_repeat_guard", "check_repeat_guards"]

logger = logging.getLogger("coordexp.rollout.server")
REPEAT_GUARD_ENDPOINT = "coordexp/repeat_guard"
GuardState = Literal["active", "inactive", "unknown"]
_RESTART_HINT = ("restart that server from a config with rollout_matching.repeat_terminate.enabled: true "
                 "(coordexp serve-rollout CFG --port N, the learner's own config), or set "
                 "rollout_matching.repeat_terminate.enabled: false in the learner's config")


class RepeatGuardInactiveError(ExternalSystemError, RuntimeError):
    """The config requires the repeat guard and a rollout server says its guard is off."""


def repeat_guard_reply(config: "RepeatTerminateConfig") -> dict[str, Any]:
    """The body of ``GET /coordexp/repeat_guard/``: whether the server's guard is on, and its whole subtree."""
    return {"active": bool(config.enabled), "repeat_terminate": config.model_dump(mode="json")}


@dataclass(frozen=True)
class RepeatGuardProbe:
    """One server's answer: ``state`` (``unknown`` when it cannot be checked), what was found, and the guard
    settings that differ from the learner's (``name: server value != learner value``)."""

    base_url: str
    state: GuardState
    detail: str
    differences: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "differences": list(self.differences)}


def probe_repeat_guard(client: "RolloutServerClient", expected: "RepeatTerminateConfig | None" = None
                       ) -> RepeatGuardProbe:
    """Ask one server (within its ``timeout_s``). A 404 or a body without a boolean ``active`` is ``unknown`` (not
    a coordexp server); any other failure raises the client's :class:`ServerError` naming the URL."""
    url = client.url(REPEAT_GUARD_ENDPOINT)
    try:
        body = client.request("GET", REPEAT_GUARD_ENDPOINT, timeout=client.timeout_s)
    except ServerError as exc:
        if not is_not_found(exc):
            raise
        return RepeatGuardProbe(client.base_url, "unknown", f"{url} does not exist (404: not a coordexp serve-rollout "
                                "server, e.g. swift rollout), so its repeat guard cannot be checked; make sure it "
                                "was started with coordexp's plugin (--external_plugins) and the same "
                                "repeat_terminate subtree")
    if not isinstance(body, dict) or not isinstance(body.get("active"), bool):
        return RepeatGuardProbe(client.base_url, "unknown", f"{url} answered {str(body)[:120]!r} without a boolean "
                                "'active', so its repeat guard cannot be checked")
    served = body.get("repeat_terminate") if isinstance(body.get("repeat_terminate"), dict) else {}
    differences: tuple[str, ...] = ()
    if expected is not None and body["active"]:
        wanted = expected.model_dump(mode="json")
        differences = tuple(f"{k}: server {served.get(k)!r} != learner {v!r}" for k, v in wanted.items()
                            if k in served and served[k] != v)
    state: GuardState = "active" if body["active"] else "inactive"
    detail = f"repeat guard {state}" + (f"; settings differ ({'; '.join(differences)})" if differences else "")
    return RepeatGuardProbe(client.base_url, state, detail, differences)


def check_repeat_guards(clients: Sequence["RolloutServerClient"], required: "RepeatTerminateConfig | None"
                        ) -> list[dict[str, Any]]:
    """Probe every server when ``required`` is an enabled guard (nothing is sent otherwise). Raises
    :class:`RepeatGuardInactiveError` naming every server whose guard is off; returns each probe as a dict for the
    run log (``unknown`` and differing settings are logged as warnings)."""
    if required is None or not required.enabled:
        return []
    probes = [probe_repeat_guard(c, required) for c in clients]
    inactive = [p.base_url for p in probes if p.state == "inactive"]
    if inactive:
        raise RepeatGuardInactiveError(
            f"rollout_matching.repeat_terminate.enabled is true but the repeat guard is off on rollout server(s) "
            f"{', '.join(inactive)}: rollouts would run without the guard the config requires", hint=_RESTART_HINT)
    for probe in probes:
        if probe.state == "unknown" or probe.differences:
            logger.warning("rollout server %s: %s", probe.base_url, probe.detail)
    return [p.to_dict() for p in probes]

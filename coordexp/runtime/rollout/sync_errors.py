"""The weight-sync error classes, in a module of their own so that every sync module (the transport, the store
guard, swift's wire) can raise them without importing each other."""

from __future__ import annotations

from coordexp.errors import ExternalSystemError

__all__ = ["WeightSyncError", "WeightSyncTimeout", "RemoteApplyError"]


class WeightSyncError(ExternalSystemError, RuntimeError):
    """Pushing learner weights to a rollout engine failed: the transport (rendezvous, a collective, a dead peer:
    the group is no longer usable), or the push itself (no adapter to send, rank 0 failed under DDP). The ONE
    weight-sync error: every module raises and catches this class."""


class WeightSyncTimeout(WeightSyncError):
    """A rendezvous or collective did not complete within ``timeout_s``."""


class RemoteApplyError(WeightSyncError):
    """The transfer arrived but a receiver could not apply it (e.g. an unknown parameter name); the group is
    still usable. ``errors`` maps receiver rank to its error text."""

    def __init__(self, message: str, errors: dict[int, str], *, hint: str = ""):
        super().__init__(message, hint=hint)
        self.errors = errors

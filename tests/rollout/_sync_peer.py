"""The server end of the weight-sync tests, run in a spawned process: receives what the parent announces on a queue
(standing in for the HTTP POSTs) and reports what it applied."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def receiver_main(port: int, commands, results, timeout_s: float = 20.0) -> None:
    """Commands: ("bucket", metadata dicts, fail_names) -> receive and apply (raising for names in fail_names),
    ("exit",) -> leave without closing (a dead peer), ("close",) -> close and report what was applied."""
    from coordexp.runtime.rollout.protocol import FlattenedTensorMetadata
    from coordexp.runtime.rollout.weight_sync import WeightSyncError, WeightSyncReceiver

    receiver = WeightSyncReceiver(timeout_s=timeout_s, backend="gloo")
    try:
        receiver.init("127.0.0.1", port, 2)
    except WeightSyncError as exc:
        results.put(("init_failed", str(exc)))
        return
    results.put(("ready", None))
    applied: dict[str, list] = {}
    errors: list[str | None] = []
    while True:
        command = commands.get(timeout=60)
        if command[0] == "exit":
            return
        if command[0] == "close":
            receiver.close()
            results.put(("applied", {k: v for k, v in applied.items()}, errors))
            return
        _, raw, fail_names = command
        metadatas = [FlattenedTensorMetadata.model_validate(m) for m in raw]

        def apply(named, fail_names=fail_names):
            for name, tensor in named:
                if name in fail_names:
                    raise KeyError(f"{name} is not a parameter of the served model")
            for name, tensor in named:
                applied[name] = [str(tensor.dtype), list(tensor.shape), tensor.float().flatten().tolist()]

        errors.append(receiver.receive(metadatas, apply))

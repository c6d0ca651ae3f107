"""Entry point of the torchrun-against-a-rollout-server test (one learner rank per process).

Trains from a config, then writes what this rank saw to OUT_DIR/rank<k>.json. A failure is written to
OUT_DIR/rank<k>.error.json and printed as one ``[rank k] Type: message`` line on stderr before exiting 1, so the
test can compare the two ranks' errors even though torchrun tears the group down after the first exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def main(config_path: str, out_dir: str) -> int:
    import torch

    from coordexp.runtime.train.launch import build_trainer, release_process_group
    from coordexp.schema.contract import load_contract

    rank = int(os.environ.get("RANK", "0"))
    trainer = None
    try:
        trainer = build_trainer(load_contract(config_path))
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the test asserts on the exact error of every rank
        error = {"rank": rank, "type": type(exc).__name__, "message": str(exc)}
        with open(os.path.join(out_dir, f"rank{rank}.error.json"), "w", encoding="utf-8") as handle:
            json.dump(error, handle)
        print(f"[rank {rank}] {error['type']}: {error['message']}", file=sys.stderr, flush=True)
        return 1
    finally:
        if trainer is not None and trainer.backend is not None:
            trainer.backend.close()
    digest = hashlib.sha256()
    for name, tensor in sorted(trainer.accelerator.unwrap_model(trainer.model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    payload = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "distributed": torch.distributed.is_initialized(),
        "global_step": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "rollout_samples": [h.get("rollout/samples") for h in trainer.state.log_history if "loss" in h],
        "staleness_max": [h.get("rollout/staleness_max") for h in trainer.state.log_history if "loss" in h],
        "params_sha256": digest.hexdigest(),
        "eval_images": [h.get("eval/samples") for h in trainer.state.log_history if "eval/AP" in h],
        "sync_points": list(trainer.pipeline.sync_points),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    release_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

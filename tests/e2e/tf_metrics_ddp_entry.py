"""Entry point of the two-rank token-figure test: evaluate, train one step, evaluate; write what this rank saw to
OUT_DIR/rank<k>.json."""

from __future__ import annotations

import json
import os
import sys


def main(config_path: str, out_dir: str) -> None:
    import torch

    from coordexp.runtime.train.launch import build_trainer, release_process_group
    from coordexp.schema.contract import load_contract

    trainer = build_trainer(load_contract(config_path))
    try:
        before = trainer.evaluate()
        trainer.train()
    finally:
        if trainer.backend is not None:
            trainer.backend.close()
    rank = int(os.environ.get("RANK", "0"))
    payload = {
        "distributed": torch.distributed.is_initialized(),
        "before": {k: v for k, v in before.items() if "token" in k},
        "logs": [h for h in trainer.state.log_history if "loss" in h or "eval/token_acc" in h],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    release_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Entry point of the torchrun test: train from a config, then write what this rank saw to OUT_DIR/rank<k>.json."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch


def main(config_path: str, out_dir: str) -> None:
    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    trainer = build_trainer(load_contract(config_path))
    trainer.train()
    digest = hashlib.sha256()
    for name, tensor in sorted(trainer.accelerator.unwrap_model(trainer.model).state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    rank = int(os.environ.get("RANK", "0"))
    payload = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "distributed": torch.distributed.is_initialized(),
        "global_step": trainer.state.global_step,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "params_sha256": digest.hexdigest(),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(payload, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

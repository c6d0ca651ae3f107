"""Entry point of the torchrun tests (DDP and DeepSpeed): train from a config, then write what this rank saw to
OUT_DIR/rank<k>.json (logged values, the whole weights' digest and per-tensor norms)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch


def main(config_path: str, out_dir: str) -> None:
    from coordexp.runtime.rollout.weight_export import full_parameters
    from coordexp.runtime.train.launch import build_trainer, release_process_group
    from coordexp.schema.contract import load_contract

    trainer = build_trainer(load_contract(config_path))
    initial = {name: float(t.detach().double().norm()) for name, t in trainer.model.state_dict().items()}
    trainer.train()
    digest = hashlib.sha256()
    norms = {}
    with full_parameters(trainer.model) as model:  # whole weights also under DeepSpeed ZeRO-3 (every rank gathers)
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            norms[name] = float(tensor.detach().double().norm())
    rank = int(os.environ.get("RANK", "0"))
    payload = {
        "rank": rank,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "distributed": torch.distributed.is_initialized(),
        "global_step": trainer.state.global_step,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "evals": [h for h in trainer.state.log_history if "eval/AP" in h],
        "params_sha256": digest.hexdigest(),
        "param_norms": norms,
        "initial_param_norms": initial,
        "padding_rows": trainer.padding_rows_run,
        "rollout_decode_copies": getattr(getattr(trainer.backend, "gathered", None), "copies", None),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(payload, handle)
    release_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""A 2-process torchrun learner (gloo on CPU) against ONE real ``coordexp serve-rollout --engine hf`` process.

Server mode under DDP: every rank rolls out through the server, rank 0 alone pushes the weights after each
optimizer step (barrier -> push -> broadcast of the outcome -> barrier), and a push failure on rank 0 ends EVERY
rank with the same error instead of a hang. Also: the stage-2 server example config trains single-process against
a loopback server. Everything listens on 127.0.0.1; every wait is bounded and every process is killed at teardown.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("coordexp.runtime.server.app", reason="coordexp serve-rollout is not part of this build yet")


from testkit import (REPO, SINGLE_THREAD, ServeRolloutProcess, free_port, server_rollout,  # noqa: E402
                     torchrun_process, torchrun_two_agents)

pytestmark = pytest.mark.slow

ENTRY = Path(__file__).with_name("torchrun_server_entry.py")
TORCHRUN_TIMEOUT_S = 300
TRAINING = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "max_steps": 3,
    "logging_steps": 1,
    "save_steps": 1000,
    "packing": True,
    "packing_buffer": 64,
}
ROLLOUT = {"decode_batch_size": 2, "max_new_tokens": 16}
# Generous transport/infer limits for 3 processes sharing 2 CPU cores; each is still a bound.
SERVER_LIMITS = {"timeout_s": 60.0, "infer_timeout_s": 120.0}




@pytest.fixture()
def start_server(tmp_path, write_config):
    """Start one server for ``model_dir`` (default: the learner's tiny model); killed at teardown."""
    started: list[ServeRolloutProcess] = []

    def start(model_dir: Path | None = None) -> ServeRolloutProcess:
        overrides: dict = {"rollout_matching": {**ROLLOUT}}
        if model_dir is not None:
            overrides["model"] = {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"}
        server = ServeRolloutProcess(write_config(overrides, name=f"server{len(started)}.yaml"),
                                     tmp_path / f"server{len(started)}.log", env=SINGLE_THREAD)
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.kill()


def learner_config(write_config, tmp_path: Path, server: ServeRolloutProcess, *, overlap: bool = False,
                   max_steps: int = TRAINING["max_steps"], **sections: dict) -> Path:
    rollout = server_rollout([(server.base_url, free_port())], server=SERVER_LIMITS, **ROLLOUT,
                             overlap={"enabled": overlap})
    training = {**TRAINING, "max_steps": max_steps, "output_dir": str(tmp_path / "run"),
                **sections.pop("training", {})}
    return write_config({"training": training, "global_max_length": 1024, "rollout_matching": rollout, **sections},
                        name="learner.yaml")


def run_torchrun(config: Path, out_dir: Path) -> tuple[int, str, float]:
    """(exit code, combined stderr, seconds) of a 2-process torchrun; the whole process group dies on timeout."""
    return torchrun_process(ENTRY, config, out_dir, TORCHRUN_TIMEOUT_S)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_two_ranks_evaluate_an_odd_validation_set_every_step(tmp_path, write_config, start_server, dataset, overlap):
    """A 2-rank learner against one server, evaluating 5 validation images on 2 ranks (shards of 3 and 2, chunks
    of 2: 2 vs 1 backend calls) with ``eval_steps: 1``. Each rank rolls out its training batch and its own
    evaluation shard through the server, rank 0 alone pushes the weights once per optimizer step (never per
    evaluation chunk, so no rank issues a collective the other does not), and the scored rollouts are gathered for
    AP over all 5 images (the gathered counters once crashed pickling a read-only mapping). With overlap on (issue
    14's acceptance), two steps cover one epoch of the 8-record dataset (2 ranks x batch 2 x 2 steps), so step 1's
    rollouts are the ones prefetched while step 0 trained, and the ranks stay in lockstep. Without overlap, the same
    config then runs as two torchrun agents (``--nnodes 2``, issue 55) with the same losses and weights."""
    from coordexp.runtime.train.run_log import read_run_log

    val = tmp_path / "val5.jsonl"  # 5 of the dataset's images (the server may read only under its image root)
    val.write_text("".join(line + "\n" for line in dataset.train_jsonl.read_text().splitlines()[:5]))
    steps = 2
    server = start_server()
    config = learner_config(write_config, tmp_path, server, overlap=overlap, max_steps=steps,
                            training={"eval_steps": 1},
                            data={"val_jsonl": str(val), "image_root": str(dataset.root)})
    code, stderr, _ = run_torchrun(config, tmp_path)
    assert code == 0, stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["distributed"] and r["world_size"] == 2 for r in ranks)
    assert [r["global_step"] for r in ranks] == [steps, steps]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # DDP replicas agree after every step
    assert ranks[0]["rollout_samples"] == [4] * steps  # 2 ranks x batch 2, every one rolled out by the server
    # one evaluation per step on both ranks, each over all 5 images (gathered from both shards)
    assert [r["eval_images"] for r in ranks] == [[5.0] * steps] * 2
    # one weight-sync point per optimizer step (0 for step 0's rollouts, then each evaluated step), the same on both
    assert ranks[0]["sync_points"] == ranks[1]["sync_points"] == list(range(steps + 1))
    status = server.sync_status()
    # rank 0 alone pushed at each sync point: one communicator set-up, then one full-weight receive per push (the
    # tiny model fits in one bucket)
    assert status["communicator"] == "ready" and status["failed"] == 0 and status["last_error"] is None
    assert status["weights_version"] == steps + 1
    assert [op["op"] for op in status["recent"]] == ["init_communicator"] + ["update_flattened_params"] * (steps + 1)
    assert all(op["ok"] for op in status["recent"])
    rollouts = [read_run_log(tmp_path / "run", rank, event="rollout") for rank in (0, 1)]
    assert (tmp_path / "run" / "run_metadata.rank1.jsonl").is_file()
    # the two ranks rolled out different records with different seeds for the same steps
    assert rollouts[0][0]["seeds"] != rollouts[1][0]["seeds"]
    for rank, events in enumerate(rollouts):
        train = [e for e in events if e["tag"] == "train"]
        # one rollout batch per optimizer step, in order, on each rank: the same global steps on both
        assert [(e["global_step"], e["micro_step"]) for e in train] == [(t, 0) for t in range(steps)], rank
        for event in train:
            versions = event["policy_versions"]
            assert len(versions) == TRAINING["per_device_train_batch_size"]
            assert all(0 <= event["global_step"] - v <= int(overlap) for v in versions), (rank, event)
        # with overlap, really prefetched with the older policy
        assert train[1]["policy_versions"] == ([0, 0] if overlap else [1, 1]), rank
    # step 1 trained on step 0's policy with overlap, on its own without
    assert [r["staleness_max"] for r in ranks] == [[0.0, float(overlap)]] * 2
    if overlap:
        return
    # the same config as two torchrun agents on 127.0.0.1 (--nnodes 2, two "nodes", issue 55): the same losses and
    # weights, rolled out by the same server (its own group port and output folder; the first push resets the
    # server to the initial weights)
    nodes = tmp_path / "two_agents"
    nodes.mkdir()
    config = learner_config(write_config, tmp_path, server, max_steps=steps,
                            training={"eval_steps": 1, "output_dir": str(nodes / "run")},
                            data={"val_jsonl": str(val), "image_root": str(dataset.root)})
    for agent_code, output in torchrun_two_agents([str(ENTRY), str(config), str(nodes)]):
        assert agent_code == 0, output[-4000:]
    two = [json.loads((nodes / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["global_step"]) for r in two] == [(2, steps), (2, steps)]
    assert two[0]["losses"] == ranks[0]["losses"] and len(two[0]["losses"]) == steps
    assert two[0]["params_sha256"] == two[1]["params_sha256"] == ranks[0]["params_sha256"]
    assert two[0]["rollout_samples"] == [4] * steps
    assert server.sync_status()["failed"] == 0


def test_rank0_push_failure_ends_both_ranks_with_the_same_error(tmp_path, write_config, start_server):
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    # The server serves a 1-layer model: the learner's layer-1 weights have no place there, so the very first
    # push is refused by the server's engine and reported back to rank 0 through the transport.
    other = build_tiny_model(tmp_path / "one_layer_model", family="qwen2_vl", seed=0, num_layers=1)
    server = start_server(other)
    code, stderr, seconds = run_torchrun(learner_config(write_config, tmp_path, server), tmp_path)
    assert code != 0
    assert seconds < TORCHRUN_TIMEOUT_S
    errors = [json.loads((tmp_path / f"rank{r}.error.json").read_text()) for r in (0, 1)]
    assert not any((tmp_path / f"rank{r}.json").exists() for r in (0, 1))  # nobody trained past the failure
    assert errors[0]["type"] == errors[1]["type"] == "WeightSyncError"
    assert errors[0]["message"] == errors[1]["message"]
    message = errors[0]["message"]
    # The trainer's begin_step hook names the optimizer step the run stopped at (the first push, step 0).
    assert message.startswith("weight sync on learner rank 0 failed (training global step 0) (raised on every rank)")
    assert "not parameters of the served model" in message and "layers.1." in message
    for rank in (0, 1):  # each rank printed it on its own line of torchrun's combined stderr
        assert f"[rank {rank}] WeightSyncError: {message.splitlines()[0]}" in stderr
    status = server.sync_status()
    assert status["failed"] == 1 and status["weights_version"] == 0
    assert "not parameters of the served model" in status["last_error"]


def test_stage2_server_example_trains_two_steps_single_process(tmp_path, tiny_model_dir, dataset, start_server):
    from coordexp.runtime.train.launch import run_training
    from coordexp.schema.contract import load_contract
    from coordexp.schema.loader import validate_config_file

    server = start_server()
    config = {
        "extends": str(REPO / "examples" / "stage2_server_3v1.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "template": {"max_pixels": 12544, "min_pixels": 3136},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
        "training": {**TRAINING, "max_steps": 2, "output_dir": str(tmp_path / "run"), "packing_buffer": 32},
        "rollout_matching": {"decode_batch_size": 2, "max_new_tokens": 16,
                             "repeat_terminate": {"min_new_tokens": 8, "max_consecutive_token_repeats": 16,
                                                  "ngram_size": 8, "ngram_repeats": 3, "max_object_keys": 20},
                             "vllm": {"server": {"servers": [{"base_url": server.base_url,
                                                              "group_port": free_port()}], **SERVER_LIMITS}}},
    }
    path = tmp_path / "stage2_server.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    report = validate_config_file(path)
    assert report.ok, report.errors
    run = load_contract(path)
    assert run.rollout_matching.backend.kind == "vllm_server" and run.rollout_matching.backend.sync.mode == "full"
    outcome = run_training(run, print_logs=False)
    assert outcome.global_step == 2
    assert [log["rollout/samples"] for log in outcome.log_history if "loss" in log] == [2, 2]
    status = server.sync_status()
    assert status["failed"] == 0 and status["weights_version"] == 2  # pushed before step 1 and step 2

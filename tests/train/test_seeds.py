"""Rollout seeds are a pure function of (seed, global step, micro-step within the step, rank, index): a run resumed
at step k draws what the uninterrupted run drew; evaluation has its own stream (issue 12 item 2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.distribution import (
    EVAL_STREAM_OFFSET,
    eval_rollout_seed,
    rollout_seed,
    train_request_seeds,
)
from coordexp.runtime.train.launch import build_trainer
from coordexp.runtime.train.run_log import read_run_log
from coordexp.schema.contract import load_contract

SEEDS = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None)
@given(seed=SEEDS, step=st.integers(0, 10**6), world=st.integers(1, 8), per_rank=st.integers(1, 16),
       micro_steps=st.integers(1, 8))
def test_training_seeds_of_one_step_are_distinct_and_eval_never_reuses_them(seed, step, world, per_rank, micro_steps):
    training = [s for m in range(micro_steps) for r in range(world)
                for s in train_request_seeds(seed, step, m, r, world, per_rank, per_rank)]
    assert len(set(training)) == len(training)  # no two requests of a step share a seed
    assert all(1 <= s < 2**31 for s in training)
    evaluation = {eval_rollout_seed(seed, step, i) for i in range(64)}
    assert not evaluation & set(training)


@settings(max_examples=200, deadline=None)
@given(seed=SEEDS, step=st.integers(0, 10**6), index=st.integers(0, 2**20))
def test_the_eval_stream_is_the_training_rule_shifted(seed, step, index):
    assert eval_rollout_seed(seed, step, index) == rollout_seed(seed, step, EVAL_STREAM_OFFSET + index)


def test_a_rank_cannot_draw_more_seeds_than_its_stride():
    with pytest.raises(ValueError, match="stride"):
        train_request_seeds(1, 0, 0, 0, 2, 2, 3)


def _config(write_config, tmp_path, name: str):
    return load_contract(write_config({
        "training": {"output_dir": str(tmp_path / name), "per_device_train_batch_size": 1,
                     "gradient_accumulation_steps": 2, "max_steps": 4, "save_steps": 2, "logging_steps": 1,
                     "packing": False, "learning_rate": 1e-3, "seed": 7},
        "global_max_length": 1024,
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 1, "max_new_tokens": 12,
                             "decoding": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "num_beams": 1}},
    }, name=f"{name}.yaml"))


def _recording(trainer) -> list[dict]:
    """Every training rollout of ``trainer``: its step, record, seed and generated tokens."""
    drawn: list[dict] = []
    generate = trainer.backend.generate

    def record(requests):
        outputs = generate(requests)
        drawn.extend({"step": trainer.state.global_step, "source": r.record.source, "seed": r.seed,
                      "tokens": o.response_token_ids} for r, o in zip(requests, outputs))
        return outputs

    trainer.backend.generate = record
    return drawn


@pytest.mark.slow
def test_resume_draws_what_the_uninterrupted_run_drew(tmp_path, write_config):
    full = build_trainer(_config(write_config, tmp_path, "full"))
    full_draws = _recording(full)
    full.train()
    full.backend.close()

    resumed = build_trainer(_config(write_config, tmp_path, "resumed"))
    resumed_draws = _recording(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))

    assert [d["step"] for d in full_draws] == [0, 0, 1, 1, 2, 2, 3, 3]  # 2 micro-steps per optimizer step
    assert [d["step"] for d in resumed_draws] == [2, 2, 3, 3]
    assert resumed_draws == full_draws[4:]  # same records, seeds AND tokens (sampling at temperature 1)
    assert len({d["seed"] for d in full_draws}) == 8

    # the run's own metadata log: the seeds per micro-step, and where the resumed run started from
    logged = read_run_log(tmp_path / "resumed", event="rollout")
    assert [(r["global_step"], r["micro_step"], r["seeds"]) for r in logged] == [
        (d["step"], k % 2, [d["seed"]]) for k, d in enumerate(resumed_draws)]
    (start,) = read_run_log(tmp_path / "resumed", event="run_start")
    assert start["resume_from"].endswith("checkpoint-2") and start["seed"] == 7
    assert start["decoding"]["temperature"] == 1.0 and start["backend"] == "HfRolloutBackend"
    step_logs = [h for h in resumed.state.log_history if "loss" in h and h["step"] > 2]  # after the resume
    assert [h["rollout/seed_first"] for h in step_logs] == [float(d["seed"]) for d in resumed_draws[::2]]

    # evaluation draws from its own stream, not the next training micro-step's seeds
    records = list(resumed.train_dataset.records[:2])
    list(resumed.pipeline.eval_chunks(records, resumed.state.global_step))
    resumed.backend.close()
    eval_seeds = [s for r in read_run_log(tmp_path / "resumed", event="rollout") if r["tag"] == "eval"
                  for s in r["seeds"]]
    assert eval_seeds == [eval_rollout_seed(7, 4, i) for i in range(2)]
    assert not set(eval_seeds) & {d["seed"] for d in full_draws}

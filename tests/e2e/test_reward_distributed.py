"""The reward objective trains the same under DDP and ZeRO-2 as in one process (issue 52; docs/design.md, decision 19),
and its two ranks stay in lockstep: its figures are collectives every rank calls in the same order.

One process at batch 2b against two torchrun ranks (gloo on CPU) at batch b, same records, seeds and steps:
- the same rollouts: each request's seed is its position in the step's expanded request list (micro-step major,
  then rank), and accelerate hands rank r the r-th block of b records, so rank 0's requests followed by rank 1's
  are the one process's requests, seed for seed (the HF backend samples each request with its own generator);
- the same loss, gradient and weights: the policy gradient divides by the step's token count over ALL ranks (each
  rank's term times the world size, since DDP and ZeRO average the ranks' gradients), so the ranks' shares add up
  to the one process's token mean even when the ranks' rollouts differ in length, which this test makes sure of.
- the KL term (``kl_weight``) against the frozen starting model, a whole copy on every rank under DDP and ZeRO-2
  alike: 0 on the first step (the policy is the reference), not on the second.

Not compared: packing (the carry buffer is each rank's own, so which segments train in a step differs). The SFT
terms divide by all ranks' counts too (tests/e2e/test_sft_distributed.py).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from testkit import assert_ranks_train_like_one_process, train_in_process, torchrun_two_ranks

pytestmark = pytest.mark.slow

PER_RANK = 2  # images per rank and micro-step (b); the one process trains 2b
TRAINING = {"gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "save_steps": 1000,
            "packing": False, "warmup_ratio": 0.0, "learning_rate": 1.0e-3}
ROLLOUT = {"rollout_backend": "hf", "decode_batch_size": 8, "max_new_tokens": 12, "objective": "reward",
           "decoding": {"temperature": 1.0}, "gt_step_share": 0.0,
           "reward": {"group_size": 2, "kl_weight": 0.5}}  # the KL reference: a whole copy per rank, ZeRO-2 too
LOGGED = ("loss", "grad_norm", "loss/policy_gradient", "loss/kl", "loss/policy_gradient/logp_mean",
          "loss/policy_gradient/entropy", "reward/mean", "reward/advantage_mean", "reward/closing_advantage",
          "reward/zero_advantage_group_share", "reward/entropy_text", "tokens/trained", "rollout/samples")
# sampled from 8 ordinary tokens and the end of turn: rollouts close after about 9 tokens, of varied lengths
SAMPLED_IDS = 8


@pytest.fixture(scope="module")
def closing_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model, but its rollouts may only sample a few ids besides the end of turn (``suppress_tokens``,
    which the HF backend honours), so they close at varied lengths: the random model's near-uniform choice over
    the whole vocabulary almost never ends its turn, and rollouts all cut at ``max_new_tokens`` weigh the same
    on every rank, whatever the normaliser."""
    from transformers import AutoTokenizer, GenerationConfig

    path = Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("closing") / "model"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = GenerationConfig.from_pretrained(str(path))
    keep = set(range(SAMPLED_IDS)) | {tokenizer.convert_tokens_to_ids("<|im_end|>"), config.eos_token_id}
    config.suppress_tokens = sorted(set(range(len(tokenizer))) - keep | set(config.suppress_tokens))
    config.save_pretrained(str(path))
    return path


def _requests(output_dir: Path, rank: int) -> dict[tuple[int, int], list[tuple]]:
    """Per (optimizer step, micro-step): this rank's training requests as (record, seed, response tokens)."""
    name = "run_metadata.jsonl" if rank == 0 else f"run_metadata.rank{rank}.jsonl"
    events = [json.loads(line) for line in (output_dir / name).read_text().splitlines()]
    return {(e["global_step"], e["micro_step"]): list(zip(e["sources"], e["seeds"], e["response_tokens"], strict=True))
            for e in events if e["event"] == "rollout" and e["tag"] == "train"}


def test_reward_objective_under_ddp_and_zero2_trains_like_one_process(tmp_path, write_config, closing_model):
    def config(name: str, batch: int, deepspeed: str | None = None) -> tuple[Path, Path]:
        output = tmp_path / name
        training = {**TRAINING, "per_device_train_batch_size": batch, "output_dir": str(output)}
        if deepspeed is not None:
            training["deepspeed"] = deepspeed
        return write_config({"model": {"path": str(closing_model)}, "global_max_length": 1024,
                             "training": training, "rollout_matching": ROLLOUT}, name=f"{name}.yaml"), output

    single_config, single_dir = config("single", 2 * PER_RANK)
    single = train_in_process(single_config, tmp_path / "out_single")
    requests = _requests(single_dir, 0)
    steps = TRAINING["max_steps"]
    assert single["global_step"] == steps and len(single["logs"]) == steps
    assert len(requests) == steps * TRAINING["gradient_accumulation_steps"]
    # weights moved: a comparison of two untrained models would prove nothing
    assert single["param_norms"] != single["initial_param_norms"]
    assert abs(single["logs"][0]["loss/kl"]) < 1e-6 < single["logs"][1]["loss/kl"]  # step 1's policy is the reference

    for name, deepspeed in (("ddp", None), ("zero2", "zero2")):
        if deepspeed and importlib.util.find_spec("deepspeed") is None:
            pytest.skip("deepspeed is not installed (bash scripts/install_deepspeed.sh): DDP checked, ZeRO-2 not")
        ranks_config, ranks_dir = config(name, PER_RANK, deepspeed)
        ranks = torchrun_two_ranks(ranks_config, tmp_path / f"out_{name}")  # both ranks end with the same weights
        for log in ranks[0]["logs"]:  # a rank's groups are its own images' (2 micro-steps x 2 ranks x 2 images)
            assert log["reward/groups"] == 8 and log["reward/samples"] == log["rollout/samples"] == 16
        per_rank = [_requests(ranks_dir, rank) for rank in (0, 1)]
        # the same requests with the same seeds drew the same rollouts: rank 0's then rank 1's are the one process's
        assert {key: per_rank[0][key] + per_rank[1][key] for key in requests} == requests, name
        # the ranks' rollouts differ in length, so a per-rank token mean would weigh them unlike the one process
        assert any(sum(t for *_, t in per_rank[0][key]) != sum(t for *_, t in per_rank[1][key]) for key in requests)
        # the reward figures are collectives every rank calls in the same order: both ranks log the same numbers
        assert_ranks_train_like_one_process(single, ranks, LOGGED, name)

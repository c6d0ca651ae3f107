"""Shared pieces of the packed-forward tests: a teacher-forced workload of samples of different lengths with their
Y_train supervision, the full objective, and the packed-vs-alone logit tolerance (used for every Qwen-VL family)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from coordexp.runtime.core.parsing import parse_rollout
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.core.targets import build_train_target
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_teacher_forced
from coordexp.runtime.model.losses import SupervisionBatch, SupervisionSegment, compute_objective
from coordexp.schema.pipeline import PipelineConfig, TokenCeConfig
from coordexp.schema.template import TemplateConfig

TOKEN_CE = TokenCeConfig(rollout_fn_desc_weight=0.5, rollout_matched_prefix_struct_weight=0.5)
# (record index, number of GT objects the "rollout" already predicted): 2, 0, 5 and 3 GT objects, so the
# samples have different lengths (a matched prefix + FN tail, an empty answer, an all-FN tail, polygons).
LAYOUT = ((4, 1), (0, 0), (3, 2), (6, 3))


def packing_template(patch_size: int = 14) -> TemplateConfig:
    """4..16 merged image tokens per image for a family of ``patch_size`` (merge 2)."""
    merged = (2 * patch_size) ** 2
    return TemplateConfig(system_prompt="Find shapes.", user_prompt="List them.", min_pixels=merged * 4,
                          max_pixels=merged * 16)


def objective_pipeline() -> PipelineConfig:
    base = {"enabled": True, "weight": 1.0, "channels": ["B"]}
    coord_reg = {"coord_ce_weight": 1.0, "soft_ce_weight": 1.0, "w1_weight": 1.0, "coord_gate_weight": 1.0,
                 "text_gate_weight": 0.5, "temperature": 1.0, "target_sigma": 2.0, "target_truncate": None}
    return PipelineConfig.model_validate({
        "objective": [
            {**base, "name": "token_ce", "config": TOKEN_CE.model_dump()},
            {**base, "name": "coord_reg", "config": coord_reg},
            {**base, "name": "bbox_geo", "config": {"smoothl1_weight": 1.0, "ciou_weight": 1.0}},
        ],
        "diagnostics": [],
    })


def load_eval_model(path, attn_implementation="sdpa", dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(path), attn_implementation=attn_implementation,
                                                        dtype=dtype)
    return model.eval()


def build_workload(processor, train_jsonl, coord_vocab, template: TemplateConfig) -> SimpleNamespace:
    """Four teacher-forced samples of different lengths and their Y_train supervision (build_train_target on a
    rollout that predicted the first k GT objects exactly)."""
    tokenizer = processor.tokenizer
    records = load_records(train_jsonl)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples, targets = [], []
    for index, k in LAYOUT:
        gt = list(records[index].objects)
        parse = parse_rollout(tokenizer.encode(serialize_objects(gt[:k]), add_special_tokens=False), tokenizer,
                              coord_vocab)
        target = build_train_target(parse, gt, [(j, j) for j in range(k)], [gt[j].coords for j in range(k)],
                                    tokenizer, coord_vocab, field_order="desc_first", token_ce=TOKEN_CE, eos_id=eos)
        targets.append(target)
        samples.append(encode_teacher_forced(processor, records[index], template, target.ids))
    assert len({s.total_len for s in samples}) == len(samples)
    return SimpleNamespace(samples=samples, targets=targets, coord_ids=torch.tensor(coord_vocab.ids))


def loss_and_grads(model, batch, forward, workload):
    model.zero_grad(set_to_none=True)
    logits = forward(model, batch)
    segments = [SupervisionSegment(t.supervision, t.ids, *batch.placement(i)) for i, t in enumerate(workload.targets)]
    supervision = SupervisionBatch.from_segments(segments, batch.seq_len)
    result = compute_objective(logits, supervision, workload.coord_ids, objective_pipeline())
    result.total.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return result, grads


def assert_logits_match(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 of the logit scale (max |logit| ~ 12 here): float32 kernels block by sequence length, so
    equal maths differs by ~1e-6 relative; a leak across segments would differ by O(1)."""
    scale = max(1.0, float(expected.abs().max()))
    diff = float((actual - expected).abs().max())
    assert diff <= 1e-5 * scale, f"max |logit diff| {diff:.3g} exceeds 1e-5 x logit scale {scale:.3g}"

"""Qwen3-VL in the packed forward: patch-16 encoding, interleaved M-RoPE positions from the model's own
``get_rope_index``, DeepStack features in packed rows, and packed == unpacked (float64) as for the other families."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coordexp.runtime.model.encoding import load_processor
from coordexp.runtime.model.packed_forward import (
    collate_packed,
    collate_padded,
    mrope_index_of,
    packed_forward,
    padded_forward,
)
from packing_kit import assert_logits_match, build_workload, load_eval_model, loss_and_grads, packing_template

TEMPLATE = packing_template(16)


@pytest.fixture(scope="module")
def qwen3_dir(qwen3_model_dir):
    return qwen3_model_dir


@pytest.fixture(scope="module")
def model(qwen3_dir):
    return load_eval_model(qwen3_dir)


@pytest.fixture(scope="module")
def workload(qwen3_dir, synthetic_dataset, coord_vocab):
    return build_workload(load_processor(qwen3_dir), synthetic_dataset.train_jsonl, coord_vocab, TEMPLATE)


def test_the_tiny_model_is_qwen3_vl_with_deepstack_and_absolute_vision_positions(model, workload):
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert model.config.vision_config.patch_size == 16
    assert list(model.config.vision_config.deepstack_visual_indexes) == [0]  # feeds LLM layer 0 of 2
    assert model.config.text_config.rope_parameters["mrope_interleaved"] is True
    assert model.model.visual.pos_embed.weight.shape[0] == 256
    # a 112 px image resized to 128 px (factor 32) is 8x8 patches of 16 px = 16 merged image tokens
    for sample in workload.samples:
        assert sample.image_grid_thw.tolist() == [[1, 8, 8]]
        assert int(sample.mm_token_type_ids.sum()) == 16
        assert sample.pixel_values.shape == (64, 3 * 2 * 16 * 16)


def test_packed_positions_are_the_models_own_per_sample(model, workload):
    packed = collate_packed(workload.samples, mrope_index_of(model))
    padded = collate_padded(workload.samples, mrope_index_of(model))
    batched, _ = model.model.get_rope_index(padded.input_ids, mm_token_type_ids=padded.mm_token_type_ids,
                                            image_grid_thw=padded.image_grid_thw, attention_mask=padded.attention_mask)
    assert torch.equal(padded.position_ids, batched)
    for i, sample in enumerate(workload.samples):
        start, n = packed.segment_offsets[i], sample.total_len
        segment = packed.position_ids[:, 0, start:start + n]
        p = sample.input_ids.tolist().index(model.config.image_token_id)
        # the 4x4 merged grid sits at (p, p + row, p + col); text resumes at p + 4
        assert [tuple(segment[:, p + j].tolist()) for j in range(16)] == [
            (p, p + r, p + c) for r in range(4) for c in range(4)]
        assert segment[:, p + 16].tolist() == [p + 4] * 3
        assert torch.equal(segment, batched[:, i, :n])


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_logits_equal_each_sample_alone(qwen3_dir, workload, implementation):
    model = load_eval_model(qwen3_dir, attn_implementation=implementation)
    packed = collate_packed(workload.samples, mrope_index_of(model), pad_to=sum(s.total_len for s in
                                                                                   workload.samples) + 3)
    with torch.no_grad():
        logits = packed_forward(model, packed)[0]
        for i, sample in enumerate(workload.samples):
            start = packed.segment_offsets[i]
            alone = model(**sample.model_inputs()).logits[0]
            assert_logits_match(logits[start:start + sample.total_len], alone)


def test_packed_loss_and_gradients_equal_unpacked_exactly_in_float64(qwen3_dir, workload):
    model = load_eval_model(qwen3_dir, dtype=torch.float64)
    subset = SimpleNamespace(**{**vars(workload), "targets": workload.targets[:3]})
    samples = [SimpleNamespace(**{**vars(s), "pixel_values": s.pixel_values.double()}) for s in workload.samples[:3]]
    rope_index = mrope_index_of(model)
    packed, packed_grads = loss_and_grads(model, collate_packed(samples, rope_index), packed_forward, subset)
    padded, padded_grads = loss_and_grads(model, collate_padded(samples, rope_index), padded_forward, subset)
    assert abs(float(packed.total.detach()) - float(padded.total.detach())) <= 1e-10
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=0, atol=1e-10, msg=name)
    # DeepStack mergers and the learned position table are trained through the packed row
    for name in ("model.visual.deepstack_merger_list.0.linear_fc2.weight", "model.visual.pos_embed.weight"):
        assert float(packed_grads[name].abs().sum()) > 0, name


def test_deepstack_features_reach_only_their_own_segment(model, workload):
    """Changing one sample's image changes its segment's logits (DeepStack and merger features both land at its
    image positions) and leaves every other segment bit-for-bit within float32 noise."""
    rope_index = mrope_index_of(model)
    original = workload.samples
    changed = SimpleNamespace(**{**vars(original[2]), "pixel_values": original[2].pixel_values.flip(0)})
    with torch.no_grad():
        before = packed_forward(model, collate_packed(original, rope_index))[0]
        after = packed_forward(model, collate_packed([*original[:2], changed, *original[3:]], rope_index))[0]
        deepstack_off = model.model.language_model._deepstack_process
        model.model.language_model._deepstack_process = lambda hidden, mask, embeds: hidden
        try:
            without_deepstack = packed_forward(model, collate_packed(original, rope_index))[0]
        finally:
            model.model.language_model._deepstack_process = deepstack_off
    batch = collate_packed(original, rope_index)
    for i, sample in enumerate(original):
        span = slice(batch.segment_offsets[i], batch.segment_offsets[i] + sample.total_len)
        if i == 2:  # (sample 1's image is blank: no objects)
            assert (before[span] - after[span]).abs().max() > 1e-2
        else:
            torch.testing.assert_close(after[span], before[span], rtol=0, atol=1e-5)
        assert (before[span] - without_deepstack[span]).abs().max() > 1e-3  # DeepStack is on in packed rows

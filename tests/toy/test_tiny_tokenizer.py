"""The offline tiny tokenizer: deterministic, Qwen-shaped, with fused closing punctuation and single coord tokens."""

from __future__ import annotations

import time

import pytest

from coordexp.runtime.toy.tiny import QWEN_SPECIAL_TOKENS, TINY_BPE_VOCAB_SIZE, build_tiny_tokenizer


def test_build_is_fast_and_deterministic(tmp_path, tiny_tokenizer_dir):
    started = time.perf_counter()
    build_tiny_tokenizer(tmp_path / "again")
    assert time.perf_counter() - started < 15
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tiny_tokenizer_dir / "tokenizer.json").read_bytes()


def test_layout_specials_and_coords(tiny_tokenizer, coord_vocab):
    assert len(tiny_tokenizer) == TINY_BPE_VOCAB_SIZE + len(QWEN_SPECIAL_TOKENS) + 1000
    special_ids = [tiny_tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS]
    assert special_ids == list(range(TINY_BPE_VOCAB_SIZE, TINY_BPE_VOCAB_SIZE + 8))
    assert coord_vocab.ids == tuple(range(TINY_BPE_VOCAB_SIZE + 8, TINY_BPE_VOCAB_SIZE + 8 + 1000))
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    for text in QWEN_SPECIAL_TOKENS:
        assert tiny_tokenizer.encode(text, add_special_tokens=False) == [tiny_tokenizer.convert_tokens_to_ids(text)]


@pytest.mark.parametrize("fused", ["}}", "},", '"]', '"},', '"}}', '"]},', '"]}}', ' {"', '{"', ' ["', '":', '",'])
def test_fused_structure_tokens_exist(piece_id, fused):
    piece_id(fused)  # raises when the tokenizer lacks it


def test_detection_json_uses_fused_closers(tiny_tokenizer):
    text = '{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_1|>", "<|coord_2|>", "<|coord_3|>", "<|coord_4|>"]}}'
    pieces = [tiny_tokenizer.decode([i]) for i in tiny_tokenizer.encode(text, add_special_tokens=False)]
    assert pieces[0] == '{"'
    assert pieces[-1] == '"]}}'
    assert pieces.count("<|coord_1|>") == 1


def test_coord_tokens_survive_skip_special_tokens_and_round_trip(tiny_tokenizer):
    text = '{"object_1": {"desc": "café 猫", "poly": [<|coord_0|>, <|coord_999|>]}}'
    ids = tiny_tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tiny_tokenizer.decode(ids) == text + "<|im_end|>"


def test_chat_template_is_qwen2_vl(tiny_tokenizer):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect."}]}]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Detect.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text_only = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], tokenize=False
    )
    assert text_only == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"

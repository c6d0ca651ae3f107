"""Coord vocabulary: bin <-> id mapping, its failure modes, and growing a checkpoint's vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from coordexp.runtime.core.tokens import (
    ALL_COORD_TOKENS,
    NUM_COORD_BINS,
    CoordVocab,
    add_coord_tokens,
    coord_token,
    parse_coord_token,
)


def test_coord_token_text_round_trips():
    assert coord_token(0) == "<|coord_0|>"
    assert coord_token(999) == "<|coord_999|>"
    assert coord_token(np.int64(7)) == "<|coord_7|>"
    assert parse_coord_token("<|coord_42|>") == 42
    for bad in ("<|coord_1000|>", "<|coord_|>", " <|coord_1|>", "<|coord_1|>x", "coord_1", "<|coord_-1|>"):
        assert parse_coord_token(bad) is None
    with pytest.raises(ValueError, match="outside 0..999"):
        coord_token(1000)
    with pytest.raises(TypeError):
        coord_token(True)
    with pytest.raises(TypeError):
        coord_token(1.0)


def test_vocab_of_tiny_tokenizer_maps_bins_to_single_tokens(tiny_tokenizer, coord_vocab):
    assert len(coord_vocab.ids) == NUM_COORD_BINS
    for k in (0, 1, 500, 999):
        token_id = coord_vocab.id_of(k)
        assert tiny_tokenizer.convert_ids_to_tokens(token_id) == f"<|coord_{k}|>"
        assert tiny_tokenizer.encode(f"<|coord_{k}|>", add_special_tokens=False) == [token_id]
        assert coord_vocab.bin_of(token_id) == k
        assert coord_vocab.is_coord(token_id)
    text_id = tiny_tokenizer.encode("cat", add_special_tokens=False)[0]
    assert coord_vocab.bin_of(text_id) is None and not coord_vocab.is_coord(text_id)
    assert coord_vocab.bin_of(10**9) is None and coord_vocab.bin_of(-1) is None
    assert coord_vocab.id_set.isdisjoint(tiny_tokenizer.all_special_ids)


def test_bins_of_is_vectorised_and_marks_non_coord_ids(tiny_tokenizer, coord_vocab):
    ids = tiny_tokenizer.encode('["<|coord_3|>", <|coord_999|>]', add_special_tokens=False)
    bins = coord_vocab.bins_of(ids)
    assert bins.dtype == np.int32
    assert sorted(bins[bins >= 0].tolist()) == [3, 999]
    assert (bins == -1).sum() == len(ids) - 2
    assert coord_vocab.bins_of(np.array([[coord_vocab.id_of(5), 10**7]])).tolist() == [[5, -1]]
    assert np.array_equal(coord_vocab.id_array, np.asarray(coord_vocab.ids))


def test_from_ids_rejects_wrong_count_collisions_and_special_clashes():
    ids = list(range(100, 1100))
    with pytest.raises(ValueError, match="expected 1000"):
        CoordVocab.from_ids(ids[:-1])
    collided = ids.copy()
    collided[7] = collided[3]
    with pytest.raises(ValueError, match=r"<\|coord_3\|> and <\|coord_7\|> both map to id 103"):
        CoordVocab.from_ids(collided)
    with pytest.raises(ValueError, match="special tokens"):
        CoordVocab.from_ids(ids, special_ids=[105])
    with pytest.raises(ValueError, match="negative"):
        CoordVocab.from_ids([-1] + ids[1:])


def _tokenizer_without_coords(tiny_tokenizer_dir):
    """The tiny tokenizer with its 1000 coord tokens removed: what a real base checkpoint looks like."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<|coord_")]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def test_from_tokenizer_names_missing_tokens_and_the_fix(tiny_tokenizer_dir):
    base = _tokenizer_without_coords(tiny_tokenizer_dir)
    with pytest.raises(ValueError, match=r"lacks 1000 of the 1000 coord tokens.*add_coord_tokens"):
        CoordVocab.from_tokenizer(base)


def test_from_tokenizer_rejects_coord_text_that_is_not_one_token(tiny_tokenizer_dir):
    """A vocab entry named like a coord token that the tokenizer never emits as one id is unusable."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    data = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|coord_5|>"]
    data["model"]["vocab"]["<|coord_5|>"] = 2056 + 5  # in the BPE vocab, but BPE never produces it from text
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"do not encode to a single id, e\.g\. <\|coord_5\|>"):
        CoordVocab.from_tokenizer(tok)


def _tiny_lm(vocab_size: int, tie: bool):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=tie,
    )
    return Qwen2ForCausalLM(config)


def _assert_drawn_around_the_mean(new, old) -> None:
    """New rows: pairwise distinct, centred on the old rows' mean, spread NEW_ROW_SPREAD x the old spread."""
    import torch

    from coordexp.runtime.core.tokens import NEW_ROW_SPREAD

    new, old = new.double(), old.double()
    assert len({tuple(row) for row in new.tolist()}) == len(new)
    spread = old.std(0, unbiased=False)
    standard_error = NEW_ROW_SPREAD * spread / len(new) ** 0.5
    assert torch.all((new.mean(0) - old.mean(0)).abs() <= 5 * standard_error)
    ratio = new.std(0) / (NEW_ROW_SPREAD * spread)
    assert torch.all((ratio > 0.8) & (ratio < 1.2)), ratio


@pytest.mark.parametrize("tie", [False, True])
def test_add_coord_tokens_grows_embeddings_with_distinct_rows_around_the_mean_and_is_idempotent(
        tiny_tokenizer_dir, tie):
    import torch

    tok = _tokenizer_without_coords(tiny_tokenizer_dir)
    old_len = len(tok)
    model = _tiny_lm(old_len, tie)
    old_in = model.get_input_embeddings().weight.detach().clone()
    old_out = model.get_output_embeddings().weight.detach().clone()

    assert add_coord_tokens(tok, model) == NUM_COORD_BINS
    assert len(tok) == old_len + NUM_COORD_BINS
    vocab = CoordVocab.from_tokenizer(tok)
    assert min(vocab.ids) == old_len
    new_in = model.get_input_embeddings().weight.detach()
    new_out = model.get_output_embeddings().weight.detach()
    assert new_in.shape[0] == new_out.shape[0] == old_len + NUM_COORD_BINS
    assert torch.equal(new_in[:old_len], old_in)
    _assert_drawn_around_the_mean(new_in[old_len:], old_in)
    if tie:
        assert new_out.data_ptr() == new_in.data_ptr()
    else:
        assert torch.equal(new_out[:old_len], old_out)
        _assert_drawn_around_the_mean(new_out[old_len:], old_out)
        assert not torch.allclose(new_out[old_len:] - old_out.mean(0), new_in[old_len:] - old_in.mean(0))
    # added as non-special tokens: they survive skip_special_tokens
    ids = tok.encode('["<|coord_7|>"]<|im_end|>', add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == '["<|coord_7|>"]'

    snapshot = new_in.clone()
    assert add_coord_tokens(tok, model) == 0
    assert len(tok) == old_len + NUM_COORD_BINS
    assert torch.equal(model.get_input_embeddings().weight.detach(), snapshot)

    again = _tiny_lm(old_len, tie)  # the same checkpoint expanded again: the same rows
    add_coord_tokens(_tokenizer_without_coords(tiny_tokenizer_dir), again)
    assert torch.equal(again.get_input_embeddings().weight.detach(), new_in)
    assert torch.equal(again.get_output_embeddings().weight.detach(), new_out)


def test_new_rows_stay_distinct_in_bfloat16(tiny_tokenizer_dir):
    """A bfloat16 checkpoint: the spread survives rounding (a 1e-9-covariance draw would round to one row)."""
    import torch

    tok = _tokenizer_without_coords(tiny_tokenizer_dir)
    model = _tiny_lm(len(tok), tie=False).to(dtype=torch.bfloat16)
    add_coord_tokens(tok, model)
    for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        rows = matrix.detach()[CoordVocab.from_tokenizer(tok).id_array]
        assert rows.dtype == torch.bfloat16
        assert len({tuple(row) for row in rows.float().tolist()}) == NUM_COORD_BINS


def test_add_coord_tokens_reuses_padded_rows_without_resizing(tiny_tokenizer_dir):
    """Checkpoints pad their vocabulary; new ids that fit are initialised in place, the matrix keeps its size."""
    import torch

    tok = _tokenizer_without_coords(tiny_tokenizer_dir)
    old_len = len(tok)
    model = _tiny_lm(old_len + NUM_COORD_BINS + 40, tie=False)
    before = model.get_input_embeddings().weight.detach().clone()
    add_coord_tokens(tok, model)
    after = model.get_input_embeddings().weight.detach()
    assert after.shape == before.shape
    _assert_drawn_around_the_mean(after[old_len : old_len + NUM_COORD_BINS], before[:old_len])
    assert torch.equal(after[old_len + NUM_COORD_BINS :], before[old_len + NUM_COORD_BINS :])


def test_add_coord_tokens_on_complete_tokenizer_is_a_no_op(tiny_tokenizer):
    n = len(tiny_tokenizer)
    assert add_coord_tokens(tiny_tokenizer) == 0
    assert len(tiny_tokenizer) == n
    assert len(ALL_COORD_TOKENS) == NUM_COORD_BINS

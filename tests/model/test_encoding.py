"""One chat-template path for generation and teacher forcing, and the spec's two sanity checks."""

from __future__ import annotations

import pytest
import torch

from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import (
    EncodingError,
    build_messages,
    check_prompt_alignment,
    check_supervised_span,
    encode_prompt,
    encode_teacher_forced,
    render_prompt,
)
from coordexp.schema.template import TemplateConfig

TEMPLATE = TemplateConfig(system_prompt="Find shapes.", user_prompt="List them.", min_pixels=28 * 28 * 4,
                          max_pixels=28 * 28 * 16)


@pytest.fixture(scope="module")
def records(synthetic_dataset):
    return load_records(synthetic_dataset.train_jsonl)


def test_messages_are_system_then_user_with_image_and_prompt(records):
    messages = build_messages(records[0], TEMPLATE)
    assert messages == [
        {"role": "system", "content": "Find shapes."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "List them."}]},
    ]


def test_rendered_prompt_ends_with_the_generation_prompt(tiny_processor, records):
    text = render_prompt(tiny_processor, records[0], TEMPLATE)
    assert text == (
        "<|im_start|>system\nFind shapes.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>List them.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_image_tokens_follow_the_grid_and_pixel_budget(tiny_processor, records):
    tokenizer = tiny_processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    prompt = encode_prompt(tiny_processor, records[0], TEMPLATE)
    # 112 x 112 fits the budget (3136..12544 pixels): resized to 112 x 112 -> 8 x 8 patches of 14 -> 16 tokens
    assert prompt.image_grid_thw.tolist() == [[1, 8, 8]]
    assert prompt.pixel_values.shape == (64, 3 * 2 * 14 * 14)
    assert int((prompt.input_ids == pad).sum()) == 16
    assert torch.equal(prompt.mm_token_type_ids, (prompt.input_ids == pad).long())
    assert prompt.prompt_len == prompt.input_ids.shape[0] == prompt.attention_mask.sum()
    small = TemplateConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    shrunk = encode_prompt(tiny_processor, records[0], small)
    assert shrunk.image_grid_thw.tolist() == [[1, 4, 4]]  # 56 x 56 -> 4 image tokens
    assert int((shrunk.input_ids == pad).sum()) == 4
    # the text around the image is the rendered template, tokenised without added specials
    text_ids = tokenizer(render_prompt(tiny_processor, records[0], TEMPLATE), add_special_tokens=False)["input_ids"]
    collapsed = [i for k, i in enumerate(prompt.input_ids.tolist()) if i != pad or prompt.input_ids[k - 1] != pad]
    assert collapsed == text_ids


def test_teacher_forced_prompt_slice_equals_generation_prompt(tiny_processor, records):
    tokenizer = tiny_processor.tokenizer
    assistant = tokenizer('{"object_1": {"desc": "red triangle", "poly": ["<|coord_1|>"]}}',
                          add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    for record in records[:4]:
        prompt = encode_prompt(tiny_processor, record, TEMPLATE)
        sample = encode_teacher_forced(tiny_processor, record, TEMPLATE, assistant)
        assert sample.assistant_start == sample.prompt_len == prompt.prompt_len
        assert sample.input_ids[sample.assistant_start:].tolist() == assistant  # ids appended, never re-tokenised
        assert torch.equal(sample.pixel_values, prompt.pixel_values)
        assert sample.mm_token_type_ids[sample.prompt_len:].sum() == 0
        check_prompt_alignment(prompt.input_ids, sample.input_ids, sample.prompt_len)
        check_supervised_span(range(sample.prompt_len, sample.total_len), sample.prompt_len, sample.total_len)


def test_ids_that_would_retokenise_differently_are_kept_verbatim(tiny_processor, records):
    tokenizer = tiny_processor.tokenizer
    # a non-canonical split of '"]},' (one piece per character) must survive as is
    ids = [tokenizer.convert_tokens_to_ids(c) for c in ['"', ']', '}', ',']]
    sample = encode_teacher_forced(tiny_processor, records[0], TEMPLATE, ids)
    assert sample.input_ids[sample.assistant_start:].tolist() == ids
    assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids


def test_teacher_forced_forward_predicts_what_generation_emits(tiny_model_dir, tiny_processor, records):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir)).eval()
    prompt = encode_prompt(tiny_processor, records[1], TEMPLATE)
    with torch.no_grad():
        # the padded embedding rows (ids >= len(tokenizer)) have no token; a rollout backend must suppress them
        padding_ids = list(range(len(tiny_processor.tokenizer), model.config.text_config.vocab_size))
        generated = model.generate(**prompt.model_inputs(), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                   suppress_tokens=padding_ids)
        response = generated[0, prompt.prompt_len:].tolist()
        sample = encode_teacher_forced(tiny_processor, records[1], TEMPLATE, response, prompt=prompt)
        logits = model(**sample.model_inputs()).logits[0]
    check_prompt_alignment(generated[0, : prompt.prompt_len], sample.input_ids, sample.prompt_len)
    logits[:, padding_ids] = -float("inf")
    predicted = logits[sample.prompt_len - 1: -1].argmax(dim=-1).tolist()
    assert predicted == response  # same positions (M-RoPE included) in both paths


@pytest.mark.skipif("not __import__('transformers').utils.is_torchvision_available()",
                    reason="transformers 5 builds Qwen-VL processors only with torchvision")
def test_matches_the_real_processor(tiny_model_dir, records):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(tiny_model_dir))
    prompt = encode_prompt(processor, records[0], TEMPLATE)
    text = render_prompt(processor, records[0], TEMPLATE)
    reference = processor(text=[text], images=[Image.open(records[0].image_paths[0]).convert("RGB")],
                          images_kwargs={"size": {"shortest_edge": TEMPLATE.min_pixels,
                                                  "longest_edge": TEMPLATE.max_pixels}}, return_tensors="pt")
    assert reference["input_ids"][0].tolist() == prompt.input_ids.tolist()
    assert torch.equal(reference["mm_token_type_ids"][0].long(), prompt.mm_token_type_ids)
    assert torch.allclose(reference["pixel_values"], prompt.pixel_values)


def test_prompt_alignment_names_first_difference_and_lengths():
    with pytest.raises(EncodingError, match=r"differ at position 2 \(generation id 7, teacher-forced id 9; "
                                            r"generation prompt length 4, teacher-forced prompt length 4\)"):
        check_prompt_alignment([1, 2, 7, 4], torch.tensor([1, 2, 9, 4, 5, 6]), 4)
    with pytest.raises(EncodingError, match="generation prompt has 3 ids, teacher-forced sequence has 6 ids, "
                                            "prompt_len is 4"):
        check_prompt_alignment([1, 2, 3], [1, 2, 3, 4, 5, 6], 4)
    with pytest.raises(EncodingError, match="teacher-forced sequence has 2 ids"):
        check_prompt_alignment([1, 2, 3], [1, 2], 3)
    check_prompt_alignment([1, 2, 3], [1, 2, 3], 3)


def test_supervised_span_rejects_prompt_and_out_of_range_indices():
    check_supervised_span([10, 11, 19], prompt_len=10, total_len=20)
    check_supervised_span([], prompt_len=10, total_len=20)
    with pytest.raises(EncodingError, match=r"2 coord index\(es\) fall outside the assistant span \[10, 20\) "
                                            r"\(into the prompt/image prefix; first: 9\)"):
        check_supervised_span(torch.tensor([9, 12, 3]), prompt_len=10, total_len=20, what="coord")
    with pytest.raises(EncodingError, match="past the end of the sequence; first: 20"):
        check_supervised_span([15, 20], prompt_len=10, total_len=20)
    with pytest.raises(EncodingError, match="invalid span"):
        check_supervised_span([1], prompt_len=30, total_len=20)


def test_bad_assistant_ids_fail_clearly(tiny_processor, records):
    tokenizer = tiny_processor.tokenizer
    with pytest.raises(EncodingError, match=r"assistant id 999999 at response position 1 is outside"):
        encode_teacher_forced(tiny_processor, records[0], TEMPLATE, [5, 999999])
    with pytest.raises(EncodingError, match="response is empty"):
        encode_teacher_forced(tiny_processor, records[0], TEMPLATE, [])
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with pytest.raises(EncodingError, match="image/video placeholder id"):
        encode_teacher_forced(tiny_processor, records[0], TEMPLATE, [5, pad])

"""The tiny Qwen-VL checkpoint loads like a real one, sees its image, generates, backpropagates and round-trips."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.model.encoding import encode_prompt, encode_teacher_forced
from coordexp.runtime.model.merge_export import expand_vocab
from coordexp.runtime.toy.tiny_model import TINY_INIT_STD, build_tiny_model
from coordexp.runtime.core.tokens import NUM_COORD_BINS, CoordVocab
from coordexp.schema.template import TemplateConfig

TEMPLATE = TemplateConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir)).eval()


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    """Two very different images: vertical colour bands and random noise."""
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    bands = np.zeros((84, 112, 3), dtype=np.uint8)
    bands[:, :56] = (255, 0, 0)
    bands[:, 56:] = (0, 0, 255)
    noise = np.random.default_rng(7).integers(0, 256, size=(84, 112, 3), dtype=np.uint8)
    records = []
    for name, pixels in (("bands.png", bands), ("noise.png", noise)):
        Image.fromarray(pixels).save(root / name)
        records.append(DetectionRecord((root / name,), 112, 84, (), f"{name}:1"))
    return records


def _generate(model, prompt, n=16):
    with torch.no_grad():
        out = model.generate(**prompt.model_inputs(), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, prompt.prompt_len:].tolist()


def test_saved_like_a_real_checkpoint(tiny_model_dir, model, tiny_processor):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    assert config.model_type == "qwen2_vl"
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        128, 2, 2, 1)
    assert text.rope_parameters["mrope_section"] == [8, 12, 12]
    assert config.tie_word_embeddings is False
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert text.vocab_size % 64 == 0 and text.vocab_size >= len(tokenizer)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(CoordVocab.from_tokenizer(tokenizer)) == NUM_COORD_BINS
    assert model.generation_config.suppress_tokens == list(range(len(tokenizer), text.vocab_size))
    # transformers 5 writes processor_config.json when it can build the processor class (torchvision present),
    # else the transformers-4 layout preprocessor_config.json; both load with AutoProcessor / load_processor
    assert any((tiny_model_dir / name).is_file() for name in ("processor_config.json", "preprocessor_config.json"))
    assert tiny_processor.image_processor.merge_size == 2
    # init std 0.2 (not 0.02), so outputs depend on the input
    std = model.get_input_embeddings().weight.std().item()
    assert 0.5 * TINY_INIT_STD < std < 1.5 * TINY_INIT_STD


def test_build_is_deterministic_and_seeded(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)

    def digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    assert digest(again) == digest(tiny_model_dir)
    assert digest(other) != digest(tiny_model_dir)
    assert (again / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model family 'llama'.*qwen2_vl"):
        build_tiny_model(tmp_path / "m", family="llama")


def test_generation_depends_on_the_image(model, tiny_processor, two_images):
    prompts = [encode_prompt(tiny_processor, record, TEMPLATE) for record in two_images]
    assert torch.equal(prompts[0].input_ids, prompts[1].input_ids)  # same text and grid; only pixels differ
    outputs = [_generate(model, p) for p in prompts]
    assert all(len(o) == 16 for o in outputs)
    assert outputs[0] != outputs[1]
    assert _generate(model, prompts[0]) == outputs[0]  # greedy is deterministic


def test_backward_gives_finite_grads_on_every_trainable_param(model, tiny_processor, two_images):
    model.train()
    try:
        sample = encode_teacher_forced(tiny_processor, two_images[0], TEMPLATE, [10, 20, 30, 2050])
        labels = sample.input_ids.clone()
        labels[: sample.assistant_start] = -100
        model.zero_grad(set_to_none=True)
        out = model(**sample.model_inputs(), labels=labels[None])
        assert torch.isfinite(out.loss)
        out.loss.backward()
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        assert trainable
        missing = [n for n, p in trainable if p.grad is None]
        assert not missing, f"no gradient reached {missing[:5]}"
        assert all(torch.isfinite(p.grad).all() for _, p in trainable)
        assert any(p.grad.abs().sum() > 0 for n, p in trainable if n.startswith("model.visual"))  # image path
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def test_save_load_round_trip_gives_identical_logits(tmp_path, model, tiny_processor, two_images):
    from transformers import AutoModelForImageTextToText

    sample = encode_teacher_forced(tiny_processor, two_images[1], TEMPLATE, [11, 12, 13])
    inputs = sample.model_inputs()
    model.save_pretrained(str(tmp_path))
    reloaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reloaded(**inputs).logits)


@pytest.mark.parametrize("family, model_class, processor_class, patch", [
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", 14),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", 16),
])
def test_other_families_build_and_run(tmp_path, two_images, family, model_class, processor_class, patch):
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.encoding import load_processor

    path = build_tiny_model(tmp_path / family, family=family)
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    assert type(model).__name__ == model_class
    processor = load_processor(path)
    assert type(processor).__name__ == processor_class
    assert processor.image_processor.patch_size == model.config.vision_config.patch_size == patch
    prompt = encode_prompt(processor, two_images[0], TEMPLATE)
    assert len(_generate(model, prompt, n=4)) == 4


def test_qwen3_vl_chat_template_has_no_default_system_message(tmp_path):
    """Qwen3-VL's template (unlike Qwen2-VL's) adds no "You are a helpful assistant." when none is given."""
    from coordexp.runtime.model.encoding import load_processor

    processor = load_processor(build_tiny_model(tmp_path / "q3", family="qwen3_vl"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect."}]}]
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Detect.<|im_end|>\n"
                    "<|im_start|>assistant\n")


def _tokenizer_without_coord_tokens(src, dst):
    """Copy of ``src``'s tokenizer files with every ``<|coord_k|>`` added token removed (ids above them compacted)."""
    dst.mkdir()
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<|coord_")]
    (dst / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_expand_vocab_adds_coord_tokens_and_grows_embeddings(tmp_path, tiny_model_dir, qwen3_model_dir, family):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from coordexp.runtime.model.encoding import load_processor
    from coordexp.runtime.model.policy import save_processor
    from coordexp.runtime.toy.tiny_model import tiny_image_processor, tiny_model_config

    plain = tmp_path / "plain"
    _tokenizer_without_coord_tokens(tiny_model_dir if family == "qwen2_vl" else qwen3_model_dir, plain)
    tokenizer = AutoTokenizer.from_pretrained(str(plain))
    assert "<|coord_0|>" not in tokenizer.get_vocab()
    with pytest.raises(ValueError, match="lacks 1000 of the 1000 coord tokens"):
        CoordVocab.from_tokenizer(tokenizer)
    config = tiny_model_config(tokenizer, family)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    old_rows = model.get_input_embeddings().weight.shape[0]
    assert old_rows < len(tokenizer) + NUM_COORD_BINS
    model.save_pretrained(str(plain))
    save_processor(plain, family, tokenizer, tiny_image_processor(family=family))

    added = expand_vocab(plain, tmp_path / "expanded")
    assert added == NUM_COORD_BINS
    expanded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "expanded"))
    new_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "expanded"))
    vocab = CoordVocab.from_tokenizer(new_tokenizer)
    assert min(vocab.ids) >= len(tokenizer)  # appended after the existing ids
    rows = expanded.get_input_embeddings().weight.shape[0]
    assert rows >= len(new_tokenizer) > old_rows
    assert expanded.get_output_embeddings().weight.shape[0] == rows
    old = model.get_input_embeddings().weight
    new = expanded.get_input_embeddings().weight
    assert torch.equal(new[: len(tokenizer)], old[: len(tokenizer)])  # existing rows untouched
    coord_rows = new[vocab.id_array]  # distinct starts, around the old rows' mean
    assert len({tuple(row) for row in coord_rows.tolist()}) == NUM_COORD_BINS
    spread = old[: len(tokenizer)].std(dim=0)
    assert torch.all((coord_rows.mean(dim=0) - old[: len(tokenizer)].mean(dim=0)).abs() < spread / 10)
    assert expand_vocab(tmp_path / "expanded", tmp_path / "again") == 0  # idempotent
    assert type(expanded).__name__ == type(model).__name__
    processor = load_processor(tmp_path / "expanded")
    assert processor.image_processor.patch_size == (16 if family == "qwen3_vl" else 14)
    assert processor.tokenizer.chat_template == AutoTokenizer.from_pretrained(str(plain)).chat_template


def test_an_unsupported_family_is_refused_naming_the_supported_ones(tmp_path, tiny_model_dir):
    from coordexp.runtime.model.policy import LaunchError, checkpoint_family

    assert checkpoint_family(tiny_model_dir) == "qwen2_vl"
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava"}), encoding="utf-8")
    with pytest.raises(LaunchError, match="'llava' is not a supported Qwen-VL family; coordexp trains qwen2_vl, "
                                          "qwen2_5_vl, qwen3_vl"):
        checkpoint_family(other)
    from coordexp.runtime.model.checkpoint_files import CheckpointFileError

    with pytest.raises(CheckpointFileError, match="not a supported"):
        expand_vocab(other, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_init_std_parameters_set_both_towers(tiny_model_dir):
    from transformers import AutoTokenizer

    from coordexp.runtime.toy.tiny_model import tiny_model_config

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    default = tiny_model_config(tokenizer)
    assert default.text_config.initializer_range == default.vision_config.initializer_range == TINY_INIT_STD
    split = tiny_model_config(tokenizer, init_std=0.02, vision_init_std=0.3)
    assert (split.text_config.initializer_range, split.vision_config.initializer_range) == (0.02, 0.3)
    both = tiny_model_config(tokenizer, "qwen2_5_vl", init_std=0.05)
    assert both.text_config.initializer_range == both.vision_config.initializer_range == 0.05
    with pytest.raises(ValueError, match="init stds must be > 0"):
        tiny_model_config(tokenizer, init_std=0.0)


def test_coord_fourier_features_are_unit_pairs_and_smooth():
    from coordexp.runtime.toy.tiny_model import coord_fourier_features

    features = coord_fourier_features(1000, 16)
    assert features.shape == (1000, 16)
    pair_norms = features[:, :8] ** 2 + features[:, 8:] ** 2
    assert torch.allclose(pair_norms, torch.ones_like(pair_norms))
    distance = lambda a, b: (features[a] - features[b]).norm().item()  # noqa: E731
    assert distance(500, 501) < 0.2 * distance(500, 700)
    assert distance(0, 1) < distance(0, 5) < distance(0, 50)
    with pytest.raises(ValueError, match="even"):
        coord_fourier_features(1000, 15)


def test_demo_style_build_has_small_init_and_smooth_coord_rows(tmp_path):
    """init_std 0.02 for the language model, 0.2 for vision; coord rows share a direction and vary smoothly."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = build_tiny_model(tmp_path / "demo", init_std=0.02, vision_init_std=0.2, smooth_coord_embeddings=True)
    model = AutoModelForImageTextToText.from_pretrained(str(path))
    ids = torch.tensor(CoordVocab.from_tokenizer(AutoTokenizer.from_pretrained(str(path))).ids)
    embeddings = model.get_input_embeddings().weight.detach()
    text_rows = torch.ones(len(embeddings), dtype=torch.bool)
    text_rows[ids] = False
    assert 0.015 < embeddings[text_rows].std().item() < 0.025
    patch = model.model.visual.patch_embed.proj.weight.detach()
    assert 0.15 < patch.std().item() < 0.25
    for matrix in (embeddings, model.get_output_embeddings().weight.detach()):
        rows = matrix[ids]
        assert 0.015 < rows.pow(2).mean().sqrt().item() / 2**0.5 < 0.025  # shared + features, each RMS 0.02
        cosine = torch.nn.functional.cosine_similarity
        near = cosine(rows[300:301], rows[301:302]).item()
        far = cosine(rows[300:301], rows[800:801]).item()
        assert near > 0.95 and near > far
        assert cosine(rows[0:1], rows[999:1000]).item() > 0.2  # the shared direction: all coords alike in part


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tower_size_and_rotary_base_reach_the_built_model(tmp_path, family, two_images):
    """The recipe-search knobs (docs/design.md, decision 10) land in the saved checkpoint, which still loads, sees
    its image and generates; impossible shapes are refused before anything is built."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from coordexp.runtime.model.encoding import load_processor
    from coordexp.runtime.toy.tiny_model import tiny_model_config

    path = build_tiny_model(tmp_path / family, family=family, vision_width=96, vision_depth=3, rope_theta=100.0)
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    vision = model.config.vision_config
    assert (getattr(vision, "embed_dim", None) or vision.hidden_size) == 96
    assert vision.depth == 3 and vision.num_heads == 3 and len(model.model.visual.blocks) == 3
    assert model.config.text_config.rope_parameters["rope_theta"] == 100.0
    prompt = encode_prompt(load_processor(path), two_images[0], TEMPLATE)
    assert len(_generate(model, prompt, n=3)) == 3
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    for bad in ({"vision_width": 48}, {"vision_depth": 0}, {"rope_theta": float("nan")}, {"rope_theta": 1.0}):
        with pytest.raises(ValueError, match="vision_width|rope_theta"):
            tiny_model_config(tokenizer, family, **bad)

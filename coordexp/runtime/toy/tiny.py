"""A tiny, offline, deterministic Qwen2-style tokenizer for tests and demos (no downloads, a few seconds to build).

Byte-level BPE with Qwen2's pre-tokenizer split, trained on generated detection JSON (decision-3 format, both field
orders) plus English, so it has the fused closing punctuation (``}}``, ``},``, ``"]``, ``"]},`` ...) that makes the
rollout prefix cut non-trivial. Qwen chat specials and the 1000 coord tokens are single added tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterator

from coordexp.runtime.core.tokens import ALL_COORD_TOKENS, COORD_TOKEN_RE

QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TINY_BPE_VOCAB_SIZE = 2048
_CORPUS_SEED = 20240611

# One chat turn of the Qwen-VL templates: string content verbatim, or content parts (images and videos as
# <|vision_start|><|image_pad|><|vision_end|>, optional "Picture n:" ids, text verbatim), then <|im_end|>.
_QWEN_VL_TURN = (
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}"
)
_COUNTERS = "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
_GENERATION_PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

# The Qwen2-VL-Instruct chat template: a default system message when the first turn is not one.
QWEN2_VL_CHAT_TEMPLATE = (
    _COUNTERS + "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    + _QWEN_VL_TURN + "{% endfor %}" + _GENERATION_PROMPT
)

# The Qwen3-VL-Instruct chat template's output for system/user/assistant turns without tools: the same turns with no
# default system message, and the same "<|im_start|>assistant\n" generation prompt.
QWEN3_VL_CHAT_TEMPLATE = _COUNTERS + "{% for message in messages %}" + _QWEN_VL_TURN + "{% endfor %}" + _GENERATION_PROMPT

_DESCS = (
    "cat dog person car bus truck bicycle motorcycle airplane train boat bird horse sheep cow elephant bear zebra "
    "giraffe backpack umbrella handbag tie suitcase frisbee skis snowboard kite bottle cup fork knife spoon bowl "
    "banana apple sandwich orange broccoli carrot pizza donut cake chair couch bed toilet laptop mouse remote "
    "keyboard phone microwave oven toaster sink refrigerator book clock vase scissors toothbrush window door tree "
    "sign lamp pillow plate shelf building road sky grass wall floor table bench fence pole flag"
).split()
_MULTIWORD = ("stop sign", "traffic light", "fire hydrant", "parking meter", "teddy bear", "hair drier",
              "tennis racket", "wine glass", "potted plant", "dining table", "cell phone", "baseball bat",
              "t-shirt", "street lamp", "red car", "black cat", "white dog", "small boat")
_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. Detect every object in the image and answer with one JSON "
    "object. Each object has a short description and a bounding box or a polygon in normalized coordinates. "
    "A person is riding a bicycle next to a red car while a cat sleeps on the window. There are two dogs, "
    "three chairs and a table in the room. Please list the objects from top to bottom and left to right. "
    "You are a helpful assistant. What is shown in this picture? It shows a street with cars and people. "
    "Training data for detectors must be exact, because an error of one token silently corrupts every step."
)


def _coord(rng: random.Random) -> str:
    return f"<|coord_{rng.randrange(1000)}|>"


def _geometry(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.6:
        x1, y1 = rng.randrange(900), rng.randrange(900)
        x2, y2 = x1 + rng.randrange(1, 99), y1 + rng.randrange(1, 99)
        values = [f"<|coord_{v}|>" for v in (x1, y1, x2, y2)]
        return "bbox_2d", "[" + ", ".join(f'"{v}"' for v in values) + "]"
    n = rng.randrange(3, 7)
    points = [(_coord(rng), _coord(rng)) for _ in range(n)]
    style = rng.random()
    if style < 0.7:
        return "poly", "[" + ", ".join(f'"{x}", "{y}"' for x, y in points) + "]"
    if style < 0.85:
        return "poly", "[" + ", ".join(f'["{x}", "{y}"]' for x, y in points) + "]"
    return "poly", "[" + ", ".join(f"{x}, {y}" for x, y in points) + "]"


def _detection_json(rng: random.Random) -> str:
    entries = []
    for n in range(1, rng.randrange(1, 7) + 1):
        desc = rng.choice(_DESCS) if rng.random() < 0.75 else rng.choice(_MULTIWORD)
        key, value = _geometry(rng)
        fields = [f'"desc": "{desc}"', f'"{key}": {value}']
        if rng.random() < 0.3:
            fields.reverse()
        entries.append(f'"object_{n}": {{{", ".join(fields)}}}')
    return "{" + ", ".join(entries) + "}"


_SYLLABLES = ("ka", "to", "ri", "mel", "an", "sor", "vi", "den", "lu", "pra", "go", "ten", "shi", "mo", "qua",
              "ber", "ex", "ul", "fa", "nim", "zo", "tra", "pe", "dol", "ki", "ran", "so", "wen", "ja", "lix")


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(1, 4)))


def tiny_training_corpus(n_documents: int = 3000) -> Iterator[str]:
    """Generated training text, split at coord tokens exactly as the tokenizer splits added tokens out."""
    rng = random.Random(_CORPUS_SEED)
    for i in range(n_documents):
        yield from (part for part in COORD_TOKEN_RE.split(_detection_json(rng))[::2] if part)
        if i % 10 == 0:
            yield _ENGLISH
        if i % 3 == 0:
            yield " ".join(rng.sample(_DESCS, 12)) + "."
        yield " ".join(_pseudo_word(rng) for _ in range(8)).capitalize() + rng.choice(".,;!?")


def build_tiny_tokenizer(path: str | Path, *, chat_template: str = QWEN2_VL_CHAT_TEMPLATE):
    """Train, save (``save_pretrained``) and return the tiny tokenizer; ``AutoTokenizer.from_pretrained(path)`` loads it.

    Layout: BPE ids first (at most 2048), then the 8 Qwen specials, then ``<|coord_0|>`` .. ``<|coord_999|>``.
    eos is ``<|im_end|>``, pad is ``<|endoftext|>``. Same output on every call (fixed corpus, deterministic trainer).
    ``chat_template``: the family's (Qwen2-VL's by default, :data:`QWEN3_VL_CHAT_TEMPLATE` for Qwen3-VL).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    backend.train_from_iterator(tiny_training_corpus(), trainer=trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False) for t in ALL_COORD_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        chat_template=chat_template,
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return tokenizer

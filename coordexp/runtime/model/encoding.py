"""The ONE chat-template encoding used for rollout generation and for the teacher-forced forward (see
docs/design.md, encoding and sanity checks).

The prompt is rendered once (system + user with the images + prompt text), tokenised without added specials, and
each ``<|image_pad|>`` is expanded to ``prod(image_grid_thw) // merge_size**2`` copies, exactly as the Qwen-VL
processors do. The teacher-forced sequence is that prompt's ids followed by the assistant ids *as ids*: response text
is never re-tokenised, so the prompt slice is identical to what generation saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from coordexp.errors import UserInputError
from coordexp.schema.template import TemplateConfig

if TYPE_CHECKING:
    import torch

    from coordexp.runtime.model.data import DetectionRecord

__all__ = [
    "IMAGE_PAD_TOKEN",
    "EncodingError",
    "SampleLengthError",
    "check_sample_length",
    "ImageTextProcessor",
    "EncodedPrompt",
    "EncodedSample",
    "load_processor",
    "build_messages",
    "render_prompt",
    "encode_prompt",
    "encode_rendered_prompt",
    "encode_teacher_forced",
    "check_prompt_alignment",
    "check_supervised_span",
]

IMAGE_PAD_TOKEN = "<|image_pad|>"
_VISION_PLACEHOLDERS = (IMAGE_PAD_TOKEN, "<|video_pad|>")


class EncodingError(UserInputError, ValueError):
    """A prompt or teacher-forced encoding is inconsistent; training on it would silently misalign labels."""


class SampleLengthError(EncodingError):
    """A teacher-forced sample is longer than the run's token cap (``template.max_length`` or
    ``global_max_length``); the message names the record, both lengths and the mitigations."""


def check_sample_length(source: str, length: int, max_length: int) -> None:
    """Refuse a sample over the cap, as post-rollout packing refuses a segment over ``packing_length``: a sample
    the cap does not hold is never trained silently (stage 1 without packing read 2,501 tokens under a 1,024 cap)."""
    if length > max_length:
        raise SampleLengthError(
            f"{source}: the encoded sample has {length} tokens (prompt, image and target), over the cap of "
            f"{max_length} (template.max_length, else global_max_length)",
            hint="raise global_max_length (or template.max_length), lower template.max_pixels, or shorten this "
                 "record (fewer objects, shorter descs)")


@dataclass(frozen=True)
class ImageTextProcessor:
    """A tokenizer + image processor pair, used when the family's processor class cannot be built.

    transformers 5 refuses to build any Qwen-VL processor without torchvision (for its video processor). Encoding
    needs only these two parts, so both kinds of processor encode identically.
    """

    tokenizer: Any
    image_processor: Any
    chat_template: str | None = None


@dataclass(frozen=True)
class EncodedPrompt:
    """A generation prompt: 1-D ``input_ids``/``attention_mask`` (images expanded) and the vision inputs."""

    input_ids: "torch.Tensor"  # int64 (prompt_len,)
    attention_mask: "torch.Tensor"  # int64 (prompt_len,), all ones
    mm_token_type_ids: "torch.Tensor"  # int64 (prompt_len,): 1 at image tokens, else 0 (drives the M-RoPE index)
    pixel_values: "torch.Tensor"  # float (n_patches, channels * temporal_patch * patch * patch)
    image_grid_thw: "torch.Tensor"  # int64 (n_images, 3)
    prompt_len: int

    def model_inputs(self) -> dict[str, "torch.Tensor"]:
        """Keyword arguments for ``model(...)`` / ``model.generate(...)`` with a batch of one."""
        return _model_inputs(self)


@dataclass(frozen=True)
class EncodedSample:
    """A teacher-forced sequence: prompt ids then assistant ids; ``input_ids[assistant_start:]`` is the response."""

    input_ids: "torch.Tensor"  # int64 (prompt_len + n_assistant,)
    attention_mask: "torch.Tensor"  # int64, all ones
    mm_token_type_ids: "torch.Tensor"  # int64: 1 at image tokens, else 0
    pixel_values: "torch.Tensor"
    image_grid_thw: "torch.Tensor"
    prompt_len: int
    assistant_start: int

    def model_inputs(self) -> dict[str, "torch.Tensor"]:
        """Keyword arguments for ``model(...)`` with a batch of one (add ``labels`` yourself)."""
        return _model_inputs(self)

    @property
    def total_len(self) -> int:
        return int(self.input_ids.shape[0])


def _model_inputs(encoded: EncodedPrompt | EncodedSample) -> dict[str, "torch.Tensor"]:
    # transformers 5 Qwen-VL models need mm_token_type_ids for the multimodal rope index; without it generate()
    # silently falls back to text-only positions for the image tokens.
    return {
        "input_ids": encoded.input_ids[None],
        "attention_mask": encoded.attention_mask[None],
        "mm_token_type_ids": encoded.mm_token_type_ids[None],
        "pixel_values": encoded.pixel_values,
        "image_grid_thw": encoded.image_grid_thw,
    }


def load_processor(path: str | Path) -> Any:
    """``AutoProcessor.from_pretrained(path)``, or an :class:`ImageTextProcessor` of the same files when the
    processor class cannot be built in this environment (transformers 5 without torchvision)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    except (TypeError, ValueError):
        image_processor = AutoImageProcessor.from_pretrained(str(path))
    return ImageTextProcessor(tokenizer=tokenizer, image_processor=image_processor,
                              chat_template=tokenizer.chat_template)


def build_messages(record: "DetectionRecord", template: TemplateConfig) -> list[dict[str, Any]]:
    """System message, then one user turn with every image of the record followed by the prompt text."""
    user_content: list[dict[str, Any]] = [{"type": "image"} for _ in record.image_paths]
    user_content.append({"type": "text", "text": template.user_prompt})
    return [
        {"role": "system", "content": template.system_prompt},
        {"role": "user", "content": user_content},
    ]


def _chat_template(processor: Any) -> str:
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if not template:
        raise EncodingError(
            "the processor has no chat template; save one with the checkpoint (chat_template.jinja or the "
            "tokenizer's chat_template) so generation and training render the same prompt"
        )
    return template


def render_prompt(processor: Any, record: "DetectionRecord", template: TemplateConfig) -> str:
    """The prompt text with ``add_generation_prompt=True`` and one ``<|image_pad|>`` per image (not yet expanded)."""
    text = processor.tokenizer.apply_chat_template(
        build_messages(record, template), chat_template=_chat_template(processor), tokenize=False,
        add_generation_prompt=True,
    )
    if text.count(IMAGE_PAD_TOKEN) != len(record.image_paths):
        raise EncodingError(
            f"{record.source}: the chat template rendered {text.count(IMAGE_PAD_TOKEN)} {IMAGE_PAD_TOKEN} "
            f"placeholders for {len(record.image_paths)} image(s); use a Qwen-VL chat template that emits one "
            "<|vision_start|><|image_pad|><|vision_end|> per image"
        )
    return text


def load_images(record: "DetectionRecord") -> list[Any]:
    """Decode the record's images as RGB, in the frame a viewer shows (EXIF orientation applied, as the annotations
    are). Each is opened with the loader's header checks (pixel cap, aspect ratio);
    any failure, a corrupt body included, is an :class:`EncodingError` naming ``file:line``, the field and the path."""
    from coordexp.runtime.model.data import ImageFileError, open_image, upright

    images = []
    for index, path in enumerate(record.image_paths):
        try:
            with open_image(path) as image:
                images.append(upright(image).convert("RGB"))  # the frame the boxes are in (EXIF applied)
        except ImageFileError as exc:
            raise EncodingError(f"{record.source}: images[{index}]: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - decoding raises OSError, ValueError, SyntaxError, struct.error...
            raise EncodingError(f"{record.source}: images[{index}]: cannot decode image {path} "
                                f"({type(exc).__name__}: {exc}); re-save or remove it") from None
    return images


def encode_prompt(processor: Any, record: "DetectionRecord", template: TemplateConfig) -> EncodedPrompt:
    """Encode the generation prompt of ``record``; images are resized within the template's pixel budget."""
    return encode_rendered_prompt(processor, render_prompt(processor, record, template), record, template)


def encode_rendered_prompt(processor: Any, text: str, record: "DetectionRecord",
                           template: TemplateConfig) -> EncodedPrompt:
    """Encode an already rendered prompt ``text`` holding one ``<|image_pad|>`` per image of ``record`` (none: a
    text-only prompt). The tail of :func:`encode_prompt`, shared with the rollout server's other chat shapes."""
    import torch

    tokenizer, image_processor = processor.tokenizer, processor.image_processor
    if record.image_paths:
        vision = image_processor(
            images=load_images(record),
            size={"shortest_edge": template.min_pixels, "longest_edge": template.max_pixels},
            return_tensors="pt",
        )
    else:  # no vision input: zero patch rows of the processor's width, so batches with images still concatenate
        width = 3 * int(image_processor.temporal_patch_size) * int(image_processor.patch_size) ** 2
        vision = {"pixel_values": torch.zeros((0, width)), "image_grid_thw": torch.zeros((0, 3), dtype=torch.long)}
    grid = torch.as_tensor(vision["image_grid_thw"], dtype=torch.long).reshape(-1, 3)
    merge = int(getattr(image_processor, "merge_size", 2))
    per_image = [int(n) for n in (grid.prod(dim=1) // (merge * merge)).tolist()]
    pad_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expanded: list[int] = []
    image_index = 0
    for token_id in ids:
        if token_id == pad_id:
            expanded.extend([pad_id] * per_image[image_index])
            image_index += 1
        else:
            expanded.append(int(token_id))
    if image_index != len(per_image):
        raise EncodingError(
            f"{record.source}: the tokenised prompt has {image_index} {IMAGE_PAD_TOKEN} ids for {len(per_image)} "
            f"image(s); {IMAGE_PAD_TOKEN} must be a single special token of the tokenizer"
        )
    input_ids = torch.tensor(expanded, dtype=torch.long)
    return EncodedPrompt(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == pad_id).long(),
        pixel_values=torch.as_tensor(vision["pixel_values"]),
        image_grid_thw=grid,
        prompt_len=len(expanded),
    )


def encode_teacher_forced(
    processor: Any,
    record: "DetectionRecord",
    template: TemplateConfig,
    assistant_ids: Sequence[int],
    *,
    prompt: EncodedPrompt | None = None,
    max_length: int | None = None,
) -> EncodedSample:
    """Prompt ids (``prompt`` if given, e.g. the rollout's own, else :func:`encode_prompt`) + ``assistant_ids``.

    ``assistant_ids`` are appended as ids (``Y_train`` ids, EOS included); they are never decoded and re-encoded.
    ``max_length`` (the run's cap, ``RunContract.sample_max_length``): a longer sample is a
    :class:`SampleLengthError` (:func:`check_sample_length`).
    """
    import torch

    if prompt is None:
        prompt = encode_prompt(processor, record, template)
    vocab_size = len(processor.tokenizer)
    response = [int(i) for i in assistant_ids]
    bad = [(k, i) for k, i in enumerate(response) if not 0 <= i < vocab_size]
    if bad:
        k, i = bad[0]
        raise EncodingError(
            f"{record.source}: assistant id {i} at response position {k} is outside the tokenizer's vocabulary "
            f"(0..{vocab_size - 1}); ids in a model's padded embedding rows have no token: suppress them at "
            "generation (e.g. suppress_tokens=range(len(tokenizer), vocab_size))"
        )
    if not response:
        raise EncodingError(f"{record.source}: the assistant response is empty; Y_train always ends with EOS")
    vision_ids = {processor.tokenizer.convert_tokens_to_ids(t) for t in _VISION_PLACEHOLDERS}
    placeholder = next((k for k, i in enumerate(response) if i in vision_ids), None)
    if placeholder is not None:
        raise EncodingError(
            f"{record.source}: the assistant response holds an image/video placeholder id ({response[placeholder]}) "
            f"at position {placeholder}; the vision features would be misaligned. Forbid these ids in generation"
        )
    if max_length is not None:
        check_sample_length(record.source, int(prompt.input_ids.numel()) + len(response), max_length)
    response_ids = torch.tensor(response, dtype=torch.long)
    input_ids = torch.cat([prompt.input_ids, response_ids])
    return EncodedSample(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=torch.cat([prompt.mm_token_type_ids, torch.zeros_like(response_ids)]),
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        prompt_len=prompt.prompt_len,
        assistant_start=prompt.prompt_len,
    )


def _as_int_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def check_prompt_alignment(generation_prompt_ids: Any, teacher_forced_ids: Any, prompt_len: int) -> None:
    """Sanity check (a): the teacher-forced prompt slice equals the ids generation was prompted with.

    Raises :class:`EncodingError` naming the first differing position and both lengths.
    """
    generated = _as_int_list(generation_prompt_ids)
    forced = _as_int_list(teacher_forced_ids)
    if len(generated) != prompt_len or len(forced) < prompt_len:
        raise EncodingError(
            f"prompt length mismatch: generation prompt has {len(generated)} ids, teacher-forced sequence has "
            f"{len(forced)} ids, prompt_len is {prompt_len}; both must come from encode_prompt on the same record "
            "and template"
        )
    for position, (a, b) in enumerate(zip(generated, forced[:prompt_len])):
        if a != b:
            raise EncodingError(
                f"prompt ids differ at position {position} (generation id {a}, teacher-forced id {b}; generation "
                f"prompt length {len(generated)}, teacher-forced prompt length {prompt_len}); the training forward "
                "must reuse the generation prompt encoding (same chat template, images and pixel budget)"
            )


def check_supervised_span(positions: Any, prompt_len: int, total_len: int, *, what: str = "supervised") -> None:
    """Sanity check (b): every supervised index (absolute, into the encoded sequence) lies in the assistant span
    ``[prompt_len, total_len)``; an index in the prompt/image prefix raises :class:`EncodingError`."""
    values = _as_int_list(positions)
    if not 0 <= prompt_len <= total_len:
        raise EncodingError(f"invalid span: prompt_len {prompt_len} is not within 0..total_len ({total_len})")
    outside = [p for p in values if not prompt_len <= p < total_len]
    if outside:
        inside_prompt = [p for p in outside if p < prompt_len]
        where = "into the prompt/image prefix" if inside_prompt else "past the end of the sequence"
        raise EncodingError(
            f"{len(outside)} {what} index(es) fall outside the assistant span [{prompt_len}, {total_len}) "
            f"({where}; first: {outside[0]}); supervision positions must be offset by prompt_len and index the "
            "assistant tokens only"
        )

"""``/infer/`` request -> encoded prompt: any chat the model's chat template accepts, images anywhere.

A request's messages (ms-swift's ``RolloutInferRequest`` rules: a trailing assistant turn is dropped; without a
system message the chat template's own default applies, as in ``swift rollout``, unless the server was started
with an explicit system prompt (``serve-rollout --system``); media are inline items OR ``<image>`` tags / empty image items
filled from the top-level ``images`` in order, never both) become the transformers chat messages the processor's
template renders. When they are exactly the learner's detection prompt (:func:`build_messages`: system, then ONE
user turn with the images followed by the prompt text), the prompt is encoded by the learner's own
:func:`encode_prompt`, so ``prompt_token_ids`` are identical by construction; any other shape (text-only,
multi-turn, text before images, images in several turns) is rendered by the same chat template and encoded by the
same tail (:func:`encode_rendered_prompt`). Detection-specific checks stay on the learner side.

Images are strings: base64 data (``data:image/...;base64,...``, or bare base64 as swift sends it, recognised by the
decoded bytes being an image), or a path read only inside ``image_root`` (relative paths are joined to it; symlinks
are resolved before the check). http(s) URLs are refused: the server runs without network access.

Hygiene: a 4xx text names the request item (``infer_requests[0].images[1]``), never a server path or an exception
text, and every refused local path gets the SAME message (outside the root, missing, a directory, unreadable name),
so the server is no oracle for which files exist. The server log keeps the detail.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.rollout.protocol import RolloutInferRequest
from coordexp.schema.template import TemplateConfig

__all__ = ["InferInputError", "IMAGE_TAG", "ServedPrompt", "request_to_prompt", "encode_served", "resolve_image",
           "scrub_paths"]

log = logging.getLogger("coordexp.serve")
IMAGE_TAG = "<image>"
_IMAGE_TYPES = ("image", "image_url")
_OTHER_MEDIA = ("audio", "audio_url", "video", "video_url")
_DATA_URI = re.compile(r"^data:(?P<mime>[\w/+.-]*)(?:;[\w=-]+)*;base64,(?P<data>.*)$", re.DOTALL)
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s_-]+$")
_IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/(?:[^\s'\"():,]+)")
REFUSED_PATH = ("not an image the server may read: a local path must name an existing file under the server's "
                "--image-root (relative paths are joined to it, symlinks resolved); or send the image as base64 data")


class InferInputError(ValueError):
    """A request the server cannot encode (answered with HTTP 400 and this text, which names no server path)."""


@dataclass(frozen=True)
class ServedPrompt:
    """One request ready to encode: ``record`` holds its resolved images (in prompt order); ``messages`` is the
    chat to render, or None when the request is the learner's detection prompt for ``template``."""

    record: DetectionRecord
    template: TemplateConfig
    messages: list[dict[str, Any]] | None


def scrub_paths(text: str, names: dict[str, str] | None = None) -> str:
    """``text`` with each known path replaced by its request-side name and any other absolute path by ``<path>``."""
    for path, name in sorted((names or {}).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    return _ABSOLUTE_PATH.sub("<path>", text)


def _looks_like_image(raw: bytes) -> bool:
    return raw.startswith(_IMAGE_MAGIC) or (raw[:4] == b"RIFF" and raw[8:12] == b"WEBP")


def _bare_base64_image(value: str) -> bytes | None:
    """The bytes of ``value`` if it is bare base64 (swift's form) of an image file, else None (then it is a path)."""
    if len(value) < 16 or not _BASE64.match(value):
        return None
    compact = "".join(value.split())
    try:
        raw = base64.b64decode(compact + "=" * (-len(compact) % 4), altchars=b"-_" if "-" in compact or "_" in compact
                               else None, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if _looks_like_image(raw) else None


def resolve_image(value: str, image_root: Path | None, scratch: Path, name: str, file_name: str) -> Path:
    """The local file of one image string (base64 data is written into ``scratch`` as ``file_name``)."""
    if value.startswith(("http://", "https://")):
        raise InferInputError(f"{name}: image URLs are not fetched: the rollout server runs without network access; "
                              "send a path under the server's --image-root or base64 data")
    data_uri = _DATA_URI.match(value)
    raw: bytes | None
    if data_uri is not None:
        try:
            raw = base64.b64decode("".join(data_uri.group("data").split()), validate=True)
        except (binascii.Error, ValueError):
            raise InferInputError(f"{name}: the data URI does not hold valid base64 data") from None
    else:
        raw = _bare_base64_image(value)
    if raw is not None:
        path = scratch / file_name
        path.write_bytes(raw)
        return path
    if image_root is None:
        raise InferInputError(f"{name}: not base64 image data, and this server reads no local files (started "
                              "without --image-root); send base64 data or restart the server with --image-root DIR")
    try:
        candidate = Path(value).expanduser()
        resolved = (candidate if candidate.is_absolute() else image_root / candidate).resolve()
        if resolved.is_relative_to(image_root) and os.access(resolved, os.R_OK) and resolved.is_file():
            return resolved
        why = "outside the image root" if not resolved.is_relative_to(image_root) else "not a readable file"
    except (OSError, ValueError, RuntimeError) as exc:  # name too long, NUL byte, unknown ~user, symlink loop
        why = f"{type(exc).__name__}: {exc}"
    log.info("refused image %s (%r): %s", name, value[:200], why)
    raise InferInputError(f"{name}: {REFUSED_PATH}")


def _text_of(content: Any) -> str | None:
    """The text of a content made of text only (a string or text items), else None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(i, dict) and i.get("type") == "text" for i in content):
        return "".join(str(i.get("text", "")) for i in content)
    return None


def _image_value(item: dict[str, Any], where: str) -> str:
    value = item.get(item["type"], item.get("image", item.get("image_url")))
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InferInputError(f"{where}: an image item holds a {type(value).__name__}; images are strings (a path "
                              "or base64 data)")
    return value


def _chat_items(content: Any, where: str) -> list[tuple[str, str]]:
    """(kind, value) items of one message: ("text", text) or ("image", inline value or "" for a slot)."""
    if content is None:
        return []
    if isinstance(content, str):
        items: list[tuple[str, str]] = []
        for k, piece in enumerate(content.split(IMAGE_TAG)):
            if k:
                items.append(("image", ""))
            if piece:
                items.append(("text", piece))
        return items
    items = []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in _IMAGE_TYPES:
            items.append(("image", _image_value(item, f"{where}.content[{k}]")))
        elif kind == "text":
            text = item.get("text", "")
            if not isinstance(text, str):
                raise InferInputError(f"{where}.content[{k}]: text must be a string")
            items.extend(_chat_items(text, where))  # an <image> tag inside a text item is a slot too
        elif kind in _OTHER_MEDIA:
            raise InferInputError(f"{where}.content[{k}]: {kind} items are not served; this server encodes text "
                                  "and images only")
        else:
            raise InferInputError(f"{where}.content[{k}] has type {kind!r}; 'text' and 'image' items are served")
    return items


def _refuse_unserved_fields(request: RolloutInferRequest, where: str) -> None:
    for field, value in (("audios", request.audios), ("videos", request.videos)):
        if value:
            raise InferInputError(f"{where}.{field}: not served; this server encodes text and images only")
    if request.tools:
        raise InferInputError(f"{where}.tools: tool definitions are not rendered by this server; send the chat "
                              "without tools")
    if request.objects:
        raise InferInputError(f"{where}.objects: grounding objects are not rendered by this server; put the text "
                              "into the messages")


def request_to_prompt(request: RolloutInferRequest, index: int, template: TemplateConfig,
                      image_root: Path | None, scratch: Path, system: str | None = None) -> ServedPrompt:
    """The images (resolved) and the chat of one request; see the module docstring for the rules. ``system``: the
    server's explicit system prompt for requests without one (None: the chat template's default)."""
    from coordexp.runtime.model.encoding import build_messages

    where = f"infer_requests[{index}]"
    _refuse_unserved_fields(request, where)
    messages = [dict(m) for m in request.messages]
    if messages and messages[-1].get("role") == "assistant":
        messages.pop()  # swift drops a trailing assistant turn too (it is not a prefill)
    if not messages:
        raise InferInputError(f"{where}.messages: nothing left to answer after the trailing assistant turn")
    if messages[0].get("role") != "system" and system is not None:
        messages.insert(0, {"role": "system", "content": system})
    chat: list[dict[str, Any]] = []
    slots: list[tuple[str, str]] = []  # (name, inline value or "") per image, in prompt order
    for m, message in enumerate(messages):
        items = _chat_items(message.get("content"), f"{where}.messages[{m}]")
        rendered: list[dict[str, Any]] = []
        for kind, value in items:
            if kind == "image":
                slots.append((f"{where}.images[{len(slots)}]", value))
                rendered.append({"type": "image"})
            else:
                rendered.append({"type": "text", "text": value})
        chat.append({**message, "content": rendered})
    inline = [value for _, value in slots if value]
    if inline and request.images:
        raise InferInputError(f"{where}: images are given both inline and in 'images'; use one of the two")
    if inline and len(inline) != len(slots):
        raise InferInputError(f"{where}: some image items are empty and others are not; fill every item or send "
                              "all images in 'images'")
    values = inline or list(request.images)
    if len(values) != len(slots):
        raise InferInputError(f"{where}: {len(slots)} image placeholder(s) ({IMAGE_TAG} tags or empty image items) "
                              f"for {len(request.images)} entries in 'images'")
    paths = tuple(resolve_image(value, image_root, scratch, name, f"r{index}_i{k}")
                  for k, ((name, _), value) in enumerate(zip(slots, values)))
    record = DetectionRecord(image_paths=paths, width=0, height=0, objects=(), source=where)
    system_text = _text_of(chat[0]["content"]) if chat[0].get("role") == "system" else None
    user = _text_of(chat[-1]["content"][-1:]) if len(chat) == 2 and chat[1]["content"] else None
    if system_text is not None and user is not None:
        detection = template.model_copy(update={"system_prompt": system_text, "user_prompt": user})
        if build_messages(record, detection) == [{"role": "system", "content": system_text}, chat[1]] \
                and set(chat[0]) == {"role", "content"} and set(chat[1]) == {"role", "content"} and paths:
            return ServedPrompt(record=record, template=detection, messages=None)
    return ServedPrompt(record=record, template=template, messages=chat)


def encode_served(processor: Any, prompt: ServedPrompt) -> Any:
    """The :class:`EncodedPrompt` of ``prompt``; template and image failures are :class:`InferInputError` whose
    text names the request's items instead of server paths."""
    from coordexp.runtime.model.encoding import (IMAGE_PAD_TOKEN, EncodingError, encode_prompt,
                                                 encode_rendered_prompt)

    names = {str(path): f"{prompt.record.source}.images[{k}]" for k, path in enumerate(prompt.record.image_paths)}
    try:
        if prompt.messages is None:
            return encode_prompt(processor, prompt.record, prompt.template)
        chat_template = getattr(processor, "chat_template", None) or processor.tokenizer.chat_template
        try:
            text = processor.tokenizer.apply_chat_template(prompt.messages, chat_template=chat_template,
                                                           tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, or a TypeError inside the template
            log.info("%s: the chat template refused the messages: %r", prompt.record.source, exc)
            detail = scrub_paths(str(exc))[:300] if type(exc).__name__ == "TemplateError" else type(exc).__name__
            raise InferInputError(f"{prompt.record.source}.messages: the model's chat template does not accept "
                                  f"these messages ({detail})") from None
        rendered = text.count(IMAGE_PAD_TOKEN)
        if rendered != len(prompt.record.image_paths):
            raise InferInputError(f"{prompt.record.source}.messages: the chat template rendered {rendered} image "
                                  f"placeholder(s) for {len(prompt.record.image_paths)} image(s); put images in "
                                  "turns the template renders")
        return encode_rendered_prompt(processor, text, prompt.record, prompt.template)
    except EncodingError as exc:
        log.info("%s: encoding failed: %s", prompt.record.source, exc)
        raise InferInputError(scrub_paths(str(exc), names)) from None

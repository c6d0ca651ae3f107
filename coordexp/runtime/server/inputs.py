"""``/infer/`` request -> encoded prompt, through the trainer's own :func:`~coordexp.runtime.model.encoding.encode_prompt`.

A request is turned back into the (record, template) pair that :func:`~coordexp.runtime.model.encoding.build_messages`
renders: an optional system message (else the config's), ONE user message whose content is the images followed by
the prompt text (inline ``{"type": "image", ...}`` items, or ``<image>`` tags with the top-level ``images``). The
prompt is then encoded by the same function the learner uses, so ``prompt_token_ids`` are identical by
construction. Other message shapes (multi-turn, text before images) are rejected with the reason, never
re-ordered.

Images are strings: a path, read only inside ``image_root`` (relative paths are joined to it; symlinks are
resolved before the check); base64 data (``data:image/...;base64,...`` or bare); http(s) URLs are REJECTED: the
server is meant to run without network access, so the client must send a path under the root or the bytes.
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Any, Sequence

from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.rollout.protocol import RolloutInferRequest
from coordexp.schema.template import TemplateConfig

__all__ = ["InferInputError", "IMAGE_TAG", "request_to_record", "resolve_image"]

IMAGE_TAG = "<image>"
_IMAGE_TYPES = ("image", "image_url")
_DATA_URI = re.compile(r"^data:(?P<mime>[\w/+.-]*)(?:;[\w=-]+)*;base64,(?P<data>.*)$", re.DOTALL)
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]+$")


class InferInputError(ValueError):
    """A request the server cannot encode (answered with HTTP 400 and this text)."""


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(i, dict) and i.get("type") == "text" for i in content):
        return "".join(str(i.get("text", "")) for i in content)
    raise InferInputError(f"{where}: content must be text (a string or text items)")


def _image_value(item: dict[str, Any]) -> str:
    value = item.get(item.get("type"), item.get("image", item.get("image_url")))
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InferInputError(f"an image item holds a {type(value).__name__}; images are strings (path or base64)")
    return value


def _user_parts(content: Any, top_level: Sequence[str], where: str) -> tuple[list[str], str]:
    """(image strings, prompt text) of the user message; images must come first."""
    if isinstance(content, str):
        text, tags = content, 0
        while text.startswith(IMAGE_TAG):
            text, tags = text[len(IMAGE_TAG):].lstrip("\n"), tags + 1
        if IMAGE_TAG in text:
            raise InferInputError(f"{where}: {IMAGE_TAG} tags must all come before the prompt text")
        if tags != len(top_level):
            raise InferInputError(f"{where}: {tags} {IMAGE_TAG} tag(s) for {len(top_level)} image(s) in 'images'; "
                                  "send one tag per image (or inline image items)")
        return list(top_level), text
    if not isinstance(content, list):
        raise InferInputError(f"{where}: content must be a string or a list of items")
    images: list[str] = []
    texts: list[str] = []
    for k, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in _IMAGE_TYPES:
            if texts:
                raise InferInputError(f"{where}: item {k} is an image after text; the detection prompt is the "
                                      "images followed by the prompt text")
            images.append(_image_value(item))
        elif kind == "text":
            texts.append(str(item.get("text", "")))
        else:
            raise InferInputError(f"{where}: item {k} has type {kind!r}; only 'image' and 'text' items are served")
    if len(texts) > 1:
        raise InferInputError(f"{where}: {len(texts)} text items; send the prompt as ONE text item after the images")
    inline = [v for v in images if v]
    if inline and top_level:
        raise InferInputError(f"{where}: images are given both inline and in 'images'; use one of the two")
    if not inline:
        if len(top_level) != len(images):
            raise InferInputError(f"{where}: {len(images)} image item(s) for {len(top_level)} entries in 'images'")
        images = list(top_level)
    elif len(inline) != len(images):
        raise InferInputError(f"{where}: some image items are empty and others are not; fill every item")
    return images, texts[0] if texts else ""


def resolve_image(value: str, image_root: Path | None, scratch: Path, name: str) -> Path:
    """The local file of one image string (base64 data is written into ``scratch`` as ``name``)."""
    if value.startswith(("http://", "https://")):
        raise InferInputError(f"{name}: image URLs are not fetched ({value[:80]}): the rollout server runs without "
                              "network access; send a path under the server's --image-root or base64 data")
    data_uri = _DATA_URI.match(value)
    if data_uri is None and image_root is not None:
        candidate = Path(value).expanduser()
        candidate = candidate if candidate.is_absolute() else image_root / candidate
        resolved = candidate.resolve()
        if resolved.is_file():
            if not resolved.is_relative_to(image_root):
                raise InferInputError(f"{name}: {value} is outside the allowed image root {image_root}; the server "
                                      "reads images only under --image-root (symlinks resolved)")
            return resolved
    payload = data_uri.group("data") if data_uri is not None else value
    if data_uri is None and (len(value) < 64 or not _BASE64.match(value)):
        if image_root is None:
            raise InferInputError(f"{name}: {value[:120]} is not base64 data, and this server reads no local files "
                                  "(started without --image-root); send base64 data or restart with --image-root DIR")
        raise InferInputError(f"{name}: image file {value} not found under the allowed image root {image_root}")
    try:
        raw = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InferInputError(f"{name}: invalid base64 image data ({exc})") from None
    path = scratch / name
    path.write_bytes(raw)
    return path


def request_to_record(request: RolloutInferRequest, index: int, template: TemplateConfig,
                      image_root: Path | None, scratch: Path) -> tuple[DetectionRecord, TemplateConfig]:
    """The record (images resolved) and template (system/user prompt of the request) that re-render the request's
    messages with :func:`~coordexp.runtime.model.encoding.build_messages`."""
    where = f"infer_requests[{index}]"
    if request.audios or request.videos:
        raise InferInputError(f"{where}: audios/videos are not served; a detection prompt holds images only")
    messages = list(request.messages)
    if messages and messages[-1].get("role") == "assistant":
        messages.pop()  # swift drops a trailing assistant turn too (it is not a prefill)
    system_prompt = template.system_prompt
    if messages and messages[0].get("role") == "system":
        system_prompt = _text_of(messages.pop(0)["content"], f"{where}.messages[0] (system)")
    if len(messages) != 1 or messages[0].get("role") != "user":
        roles = [m.get("role") for m in request.messages]
        raise InferInputError(f"{where}: messages have roles {roles}; the server encodes the detection prompt: an "
                              "optional system message and ONE user message (images, then the prompt text)")
    images, text = _user_parts(messages[0]["content"], request.images, f"{where} user message")
    if not images:
        raise InferInputError(f"{where}: no image; every detection prompt holds at least one image")
    paths = tuple(resolve_image(value, image_root, scratch, f"{where}.image{k}") for k, value in enumerate(images))
    record = DetectionRecord(image_paths=paths, width=0, height=0, objects=(), source=where)
    return record, template.model_copy(update={"system_prompt": system_prompt, "user_prompt": text})

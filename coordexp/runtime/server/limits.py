"""What the rollout server refuses before any work is queued, so no request can wedge the engine worker.

Issue 12 item 4: ``max_tokens: 2**64`` or a 20 MB prompt blocked ``/infer/`` for good, and NaN/Infinity in a body
answered 500 (FastAPI echoes the value into a 422 body that JSON cannot encode). Here:

- :class:`BodyGuard` (ASGI): a body larger than ``max_body_bytes`` is 413 before it is parsed; ``NaN``,
  ``Infinity``, numbers that overflow to infinity and integers of more than :data:`MAX_INT_DIGITS` digits are 400
  naming the JSON path (strict JSON has no non-finite numbers; a shape of a few hundred 4000-digit integers made
  the metadata check multiply for seconds on the event loop);
- :func:`validation_error_response`: a 422 whose ``detail`` names each field and never echoes the value;
- :func:`request_limits`: ``field: reason`` for every bound an ``/infer/`` request breaks: finite floats,
  ``max_tokens`` < ``max_model_len``, ``num_beams``/``n`` caps, the per-request budget of sequences x max_tokens
  (one call cannot hold the engine for long; the scheduler interleaves the rest), stop strings, text that is not
  valid Unicode (a lone surrogate such as ``\\ud800``), and the prompt's characters against what ``max_model_len``
  tokens can hold (checked before tokenizing: a 20 MB prompt is never encoded).

The NaN/Infinity scan looks at numbers outside JSON strings only (base64 image data holds "NaN" about 4 times per
MB) and runs off the event loop when the body is large.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, Awaitable, Callable, Iterable

from coordexp.schema.base import MAX_BEAMS

__all__ = ["DEFAULT_MAX_BODY_BYTES", "MAX_INT_DIGITS", "MAX_CHOICES", "MAX_SEQUENCES", "MAX_REQUEST_TOKENS",
           "MAX_STOPS", "BodyGuard", "non_finite_paths", "validation_error_detail", "request_limits", "prompt_chars",
           "max_token_chars", "invalid_text_fields"]

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # base64 images of a few large pages; --max-body-mb raises it
MAX_CHOICES = 64  # n per request (GRPO-style groups are far smaller)
MAX_SEQUENCES = 4096  # requests x n of one /infer/ call: one call's sequences fit in the worker's memory
MAX_INT_DIGITS = 30  # far above any count, size or seed the server takes (2**64 has 20 digits)
# sequences x max_tokens of one /infer/ call (--max-request-tokens): 4,096 x 1,024 (a learner rank's share of a
# step fits; the scheduler interleaves big calls with others, so this bounds memory and one call's length only)
MAX_REQUEST_TOKENS = 1 << 22
MAX_STOPS = 16  # stop strings per call (swift's clients send one or two)
MAX_STOP_CHARS = 256
_SUSPECT = re.compile(rb"NaN|Infinity|\d[eE]\+?\d{3}|\d{%d}" % (MAX_INT_DIGITS + 1))
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included
OFF_LOOP_BYTES = 256 * 1024  # bodies at least this large are scanned on a thread, never on the event loop
_FIELD_LIMIT = 8  # validation errors listed in one detail

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class _NonFinite:
    """Stands in for a NaN/Infinity literal while a body is parsed, so its path can be found."""

    def __init__(self, text: str):
        self.text = text


def _parse_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _parse_int(text: str) -> Any:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_INT_DIGITS else _NonFinite(f"{text[:12]}... ({digits} digits)")


def non_finite_paths(body: bytes) -> list[str] | None:
    """Dotted paths (``request_config.temperature``, ``metadatas[0].numel``) of non-finite numbers and over-long
    integers in a JSON body (None when the body is not JSON at all: the app's own parser answers that). Only text
    outside string literals is searched first, so image data in strings never costs a second parse."""
    if not _SUSPECT.search(body) or not _SUSPECT.search(_JSON_STRING.sub(b'""', body)):
        return []
    try:
        document = json.loads(body, parse_constant=_NonFinite, parse_float=_parse_float, parse_int=_parse_int)
    except (ValueError, RecursionError):
        return None
    found: list[str] = []
    stack: list[tuple[str, Any]] = [("", document)]
    while stack and len(found) < _FIELD_LIMIT:
        path, value = stack.pop()
        if isinstance(value, _NonFinite):
            found.append(f"{path or '(body)'} = {value.text[:24]}")
        elif isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{k}]", item) for k, item in reversed(list(enumerate(value))))
    return found


async def _answer(send: Send, status: int, detail: str) -> None:
    payload = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})


class BodyGuard:
    """ASGI middleware: cap the request body and refuse non-finite JSON numbers before the app parses them."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, max_body_bytes: int,
                 on_refusal: Callable[[str, int, str], None] | None = None):
        self.app, self.max_body_bytes, self.on_refusal = app, int(max_body_bytes), on_refusal

    async def _refuse(self, scope: Scope, send: Send, status: int, detail: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal(scope.get("path", "?"), status, detail)
        await _answer(send, status, detail)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        too_big = (f"request body larger than this server's cap of {limit} bytes ({limit / 2**20:.0f} MiB): send "
                   "fewer or smaller images per call, or restart the server with a larger --max-body-mb")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, 413, too_big)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, send, 413, too_big)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if len(body) >= OFF_LOOP_BYTES:  # a large body is scanned beside the event loop: /health/ keeps answering
            bad = await asyncio.get_running_loop().run_in_executor(None, non_finite_paths, body)
        else:
            bad = non_finite_paths(body)
        if bad:
            await self._refuse(scope, send, 400, "request body: numbers that are not finite or have more than "
                                                  f"{MAX_INT_DIGITS} digits have no meaning here: {', '.join(bad)}; "
                                                  "send finite, in-range values")
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def validation_error_detail(errors: Iterable[dict], *, prefix: str = "") -> str:
    """One line naming every invalid field (``request_config.top_p: Input should be ...``), never the value."""
    parts = []
    errors = list(errors)
    for error in errors[:_FIELD_LIMIT]:
        location = [str(x) for x in error.get("loc", ()) if x != "body"]
        path = prefix
        for item in location:
            path += f"[{item}]" if item.isdigit() else (f".{item}" if path else item)
        parts.append(f"{path or '(body)'}: {error.get('msg', 'invalid')}")
    more = f" (+{len(errors) - _FIELD_LIMIT} more)" if len(errors) > _FIELD_LIMIT else ""
    return "invalid request: " + "; ".join(parts) + more


def prompt_chars(messages: Iterable[Any]) -> int:
    """Characters of prompt text in ``messages`` (docs/design.md#ms310: string contents and text items, not images)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(item.get("text") or "") for item in content
                         if isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str))
    return total


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` spans (>= 1), so ``max_model_len * this`` characters bound
    any prompt that can fit; a cheap check that never tokenizes an oversized prompt."""
    try:
        vocab = tokenizer.get_vocab()
        return max(8, max((len(token) for token in vocab), default=8))
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: assume long tokens
        return 256


def _bad_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def invalid_text_fields(requests: Iterable[Any]) -> list[str]:
    """The fields of ``infer_requests`` whose text is not valid Unicode (lone surrogates such as ``\\ud800``, which
    strict JSON can carry but no tokenizer encodes), named like ``infer_requests[0].messages[1].role``."""
    found: list[str] = []
    for j, request in enumerate(requests):
        stack: list[tuple[str, Any]] = [(f"infer_requests[{j}].messages", request.messages),
                                        (f"infer_requests[{j}].images", request.images)]
        while stack and len(found) < _FIELD_LIMIT:
            path, value = stack.pop()
            if isinstance(value, str):
                if _bad_text(value):
                    found.append(path)
            elif isinstance(value, dict):
                for key, item in value.items():
                    if isinstance(key, str) and _bad_text(key):
                        found.append(f"{path} (a key)")
                    else:
                        stack.append((f"{path}.{key}", item))
            elif isinstance(value, list):
                stack.extend((f"{path}[{k}]", item) for k, item in enumerate(value))
    return sorted(found)


def request_limits(body: Any, *, max_model_len: int, chars_per_token: int, default_max_tokens: int = 1,
                   max_request_tokens: int = MAX_REQUEST_TOKENS) -> list[str]:
    """``field: reason`` for every bound an ``/infer/`` body (a ``protocol.InferRequestBody``) breaks;
    ``default_max_tokens``: what an unset ``max_tokens`` means on this server."""
    config = body.request_config
    refused = [f"request_config.{name}: must be a finite number (got {value})"
               for name, value in config if isinstance(value, float) and not math.isfinite(value)]
    if config.max_tokens is not None and config.max_tokens >= max_model_len:
        refused.append(f"request_config.max_tokens: {config.max_tokens} must be < this engine's max_model_len "
                       f"{max_model_len} (prompt and completion share it)")
    if config.num_beams > MAX_BEAMS:
        refused.append(f"request_config.num_beams: {config.num_beams} exceeds the cap {MAX_BEAMS}")
    if config.n > MAX_CHOICES:
        refused.append(f"request_config.n: {config.n} exceeds the cap {MAX_CHOICES} choices per request")
    elif len(body.infer_requests) * config.n > MAX_SEQUENCES:
        refused.append(f"infer_requests: {len(body.infer_requests)} requests x n={config.n} exceed "
                       f"{MAX_SEQUENCES} sequences per call; split the call")
    else:
        sequences = len(body.infer_requests) * config.n
        max_tokens = config.max_tokens if config.max_tokens is not None else default_max_tokens
        if sequences * max_tokens > max_request_tokens:
            refused.append(f"infer_requests: {sequences} sequences x max_tokens {max_tokens} = "
                           f"{sequences * max_tokens} tokens exceed this server's per-request budget of "
                           f"{max_request_tokens} (--max-request-tokens); split the call or lower max_tokens")
    if len(config.stop) > MAX_STOPS:
        refused.append(f"request_config.stop: {len(config.stop)} stop strings exceed the cap {MAX_STOPS}")
    for k, stop in enumerate(config.stop[:MAX_STOPS]):
        if not stop or len(stop) > MAX_STOP_CHARS:
            refused.append(f"request_config.stop[{k}]: a stop string must have 1..{MAX_STOP_CHARS} characters")
        elif _bad_text(stop):
            refused.append(f"request_config.stop[{k}]: not valid Unicode text (a lone surrogate)")
    refused += [f"{field}: not valid Unicode text (a lone surrogate such as \\ud800); send UTF-8 text"
                for field in invalid_text_fields(body.infer_requests)]
    char_cap = max_model_len * chars_per_token
    for j, request in enumerate(body.infer_requests):
        chars = prompt_chars(request.messages)
        if chars > char_cap:
            refused.append(f"infer_requests[{j}].messages: {chars} characters of text cannot fit in max_model_len "
                           f"{max_model_len} tokens; shorten the prompt")
    return refused

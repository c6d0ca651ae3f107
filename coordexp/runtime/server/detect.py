"""``POST /detect/``: one image in, the detector's objects out, in pixels, with scores.

The request is ``{"image": PATH_OR_BASE64, "prompt": TEXT?, "decoding": {...}?}``: the image as ``/infer/`` takes it
(a path under ``--image-root`` or base64 data, never a URL), the user text after the image (default: the config's
``template.user_prompt``, the prompt the model was trained with) and optional decoding (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``seed``; unset: the config's). It runs as one
``/infer/`` call (same queue, merging, limits and refusals; the server's system prompt, by default the config's),
and the answer is parsed exactly as training parses a rollout:

``{"objects": [{"desc", "bbox_2d": [x1, y1, x2, y2], "poly": [[x, y], ...] (polygons only), "score"}], "text": RAW,
"parse": {"image_size", "objects_written", "valid", "dropped", "truncated", "finish_reason", "score"}}``; with
``"dedup": true`` near repeats (a label-free heuristic) move from ``objects`` to ``"repeats"`` (the same form)

Coordinates are pixels of the image as sent (norm1000 bin ``b`` of a side of ``size`` pixels is ``b * size / 1000``,
:func:`~coordexp.runtime.core.coco.bin_to_pixel`); a polygon's ``bbox_2d`` is its enclosing box. ``score`` is the
probability of the object's tokens (``exp`` of their summed log-probabilities, as ``coordexp eval --score logprob``),
``null`` when the engine returns no log-probabilities; ``"score": "mean_logprob"`` makes it the mean per token (in
(0, 1], what to threshold: ``score_threshold``). Invalid objects are left out and counted in
``parse.dropped`` by reason; ``parse.finish_reason`` is ``stop``, ``length`` or ``repeat`` (the repeat guard ended
the answer). Every client error is a 4xx naming the field, never a server path.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal, Optional

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from coordexp.schema.base import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from coordexp.runtime.core.coco import object_pixel_polygon
from coordexp.runtime.core.parsing import RolloutParse, parse_rollout
from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.set_figures import near_repeats
from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.server.inputs import IMAGE_TAG, InferInputError, resolve_image

__all__ = ["DetectDecoding", "DetectRequest", "Detector", "add_detect_route", "SCORE_MEANING"]

SCORE_MEANING = "exp(sum of the object's token log-probabilities)"
MEAN_SCORE_MEANING = "exp(mean of the object's token log-probabilities)"
_PIXEL_DIGITS = 2


class DetectDecoding(BaseModel):
    """Decoding of one ``/detect/`` call; unset fields take the config's ``rollout_matching`` values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    repetition_penalty: Optional[float] = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    seed: Optional[int] = None


class DetectRequest(BaseModel):
    """The ``/detect/`` body (unknown keys are a 422 naming them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = Field(min_length=1, description="A path under the server's --image-root, or base64 image data.")
    prompt: Optional[str] = Field(None, description="User text after the image (default: template.user_prompt).")
    decoding: DetectDecoding = Field(default_factory=DetectDecoding)
    score: Literal["logprob", "mean_logprob"] = Field(
        "logprob", description="Each object's score: exp of the sum of its tokens' log-probabilities (logprob, as "
        "`coordexp eval --score logprob`: small for long objects) or of their mean (mean_logprob: a per-token "
        "probability in (0, 1], what to threshold).")
    score_threshold: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="Leave out the objects scored below it (counted in parse.below_threshold).")
    dedup: bool = Field(False, description="Move near repeats (same desc, IoU >= 0.9 with an earlier kept object; a "
                                           "heuristic that can move a true positive) from objects to repeats "
                                           "(docs/figures.md).")

    @field_validator("prompt")
    @classmethod
    def _no_image_tag(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and IMAGE_TAG in value:
            raise ValueError(f"the prompt must not hold {IMAGE_TAG}: the one image is placed before it")
        return value


class Detector:
    """Turns a :class:`DetectRequest` into an ``/infer/`` body and its answer into pixel objects."""

    def __init__(self, tokenizer: Any, user_prompt: str, image_root: Optional[Path], *, logprobs: bool):
        self.tokenizer, self.user_prompt, self.image_root, self.logprobs = tokenizer, user_prompt, image_root, logprobs
        self._vocab: Optional[CoordVocab] = None

    def vocab(self) -> CoordVocab:
        if self._vocab is None:
            try:
                self._vocab = CoordVocab.from_tokenizer(self.tokenizer)
            except (ValueError, KeyError) as exc:
                raise HTTPException(409, "/detect/: this model has no coord tokens, so its answers are not "
                                         f"detections ({str(exc)[:200]}); serve a coordexp checkpoint") from None
        return self._vocab

    def image_size(self, image: str) -> tuple[int, int]:
        """``(width, height)`` of the request's image, read through the training data's guarded opener (its pixel
        and aspect-ratio caps, as ``/infer/`` reads it): a 400 naming the field when it cannot be used. Blocking
        (temp file, header read): the route runs it off the event loop."""
        from coordexp.runtime.model.data import ImageFileError, displayed_size, open_image

        with tempfile.TemporaryDirectory(prefix="coordexp-detect-") as scratch:
            path = resolve_image(image, self.image_root, Path(scratch), "image", "detect_image")
            try:
                handle = open_image(path)
            except ImageFileError as exc:
                reason = str(exc).replace(f"{path}: ", "", 1).replace(str(path), "the image")
                raise InferInputError(f"image: {reason}") from None
            with handle:
                return displayed_size(handle)  # the frame the model saw and the boxes are in (EXIF applied)

    def infer_body(self, request: DetectRequest) -> p.InferRequestBody:
        prompt = self.user_prompt if request.prompt is None else request.prompt
        config = request.decoding.model_dump(exclude_none=True)
        return p.InferRequestBody(
            infer_requests=[p.RolloutInferRequest(messages=[{"role": "user", "content": IMAGE_TAG + prompt}],
                                                  images=[request.image])],
            request_config=p.RequestConfig(**config, return_details=True, logprobs=self.logprobs))

    def answer(self, item: dict[str, Any], size: tuple[int, int], dedup: bool = False, *, score: str = "logprob",
               score_threshold: Optional[float] = None) -> dict[str, Any]:
        """The ``/detect/`` reply of one ``/infer/`` item (see the module docstring); with ``dedup`` the near
        repeats move from ``objects`` to ``repeats`` (nothing is lost: ``text`` holds what the model wrote); with
        ``score_threshold`` the objects scored below it are left out of ``objects`` and counted."""
        choice = item["response"]["choices"][0]
        reasons = (item.get("coordexp") or {}).get("finish_reasons") or []
        finish_reason = reasons[0] if reasons else choice.get("finish_reason")  # ``repeat``: the guard stopped it
        ids = list(choice.get("token_ids") or [])
        logprobs = [float(t["logprob"]) for t in (choice.get("logprobs") or {}).get("content") or []] or None
        parse = parse_rollout(ids, self.tokenizer, self.vocab(), piece_table=PieceTable.for_tokenizer(self.tokenizer))
        objects = [detected_object(o, size, logprobs, len(ids), mean=score == "mean_logprob")
                   for o in parse.valid_objects]
        out = {"objects": objects, "text": choice["message"]["content"], "parse": parse_summary(
            parse, size, finish_reason, scored=logprobs is not None, mean=score == "mean_logprob")}
        if dedup:  # on every valid object, in written order, before any threshold
            repeats = near_repeats([o.to_det_object() for o in parse.valid_objects])
            out["objects"] = [o for o, r in zip(objects, repeats) if not r]
            out["repeats"] = [o for o, r in zip(objects, repeats) if r]
        if score_threshold is not None and logprobs is not None:
            kept = [o for o in out["objects"] if o["score"] >= score_threshold]
            out["parse"]["below_threshold"] = len(out["objects"]) - len(kept)
            out["objects"] = kept
        return out


def detected_object(parsed: Any, size: tuple[int, int], logprobs: Optional[list[float]], n_ids: int,
                    mean: bool = False) -> dict[str, Any]:
    """One valid parsed object in pixels with its score (``None`` without log-probabilities)."""
    obj = parsed.to_det_object()
    points = object_pixel_polygon(obj, *size)
    box = [*points.min(axis=0).tolist(), *points.max(axis=0).tolist()]
    out: dict[str, Any] = {"desc": obj.desc, "bbox_2d": [round(float(v), _PIXEL_DIGITS) for v in box]}
    if obj.geometry == "poly":
        out["poly"] = [[round(float(x), _PIXEL_DIGITS), round(float(y), _PIXEL_DIGITS)] for x, y in points.tolist()]
    score = None
    if logprobs is not None:
        lo, hi = parsed.token_span[0], min(parsed.token_span[1], n_ids, len(logprobs))  # a fused last brace: +1
        total = sum(logprobs[lo:hi])
        score = math.exp(total / max(1, hi - lo) if mean else total)
    out["score"] = score
    return out


def parse_summary(parse: RolloutParse, size: tuple[int, int], finish_reason: Optional[str], *, scored: bool,
                  mean: bool = False) -> dict[str, Any]:
    return {"image_size": list(size), "objects_written": len(parse.objects), "valid": len(parse.valid_objects),
            "dropped": dict(parse.dropped_by_reason), "truncated": bool(parse.truncated),
            "finish_reason": finish_reason,
            "score": (MEAN_SCORE_MEANING if mean else SCORE_MEANING) if scored else None}


def add_detect_route(app: FastAPI, detector: Detector,
                     run_infer: Callable[[p.InferRequestBody, str], Awaitable[list[dict[str, Any]]]]) -> None:
    """Register ``POST /detect/`` on ``app``; ``run_infer(body, path)`` answers an ``/infer/`` body as the
    ``/infer/`` route does (limits, queue, 4xx mapping)."""

    @app.post("/detect/")
    async def detect(body: DetectRequest) -> dict:
        try:
            size = await asyncio.to_thread(detector.image_size, body.image)
            infer_body = detector.infer_body(body)
        except InferInputError as exc:
            raise HTTPException(400, f"/detect/: {exc}") from None
        items = await run_infer(infer_body, "/detect/")
        return detector.answer(items[0], size, dedup=body.dedup, score=body.score,
                               score_threshold=body.score_threshold)

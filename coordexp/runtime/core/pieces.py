"""Per-token text pieces, built once per tokenizer, so parsing never calls ``decode`` per token.

Pieces are BYTES: a byte-level BPE token may hold part of a multi-byte UTF-8 character, and only bytes concatenate
exactly (``b"".join(pieces) .decode("utf-8", "replace") == tokenizer.decode(ids)``). JSON structure characters are
ASCII, so the parser scans bytes.
"""

from __future__ import annotations

import re
import weakref
from operator import itemgetter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
# The number of a rendered object key (an unescaped quote: never inside a JSON string).
_OBJECT_NUMBER_RE = re.compile(r'(?<!\\)"object_([0-9]+)": \{')


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of each byte -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _build_pieces(tokenizer: Any) -> list[bytes]:
    size = len(tokenizer)
    added = {int(i): tok.content for i, tok in tokenizer.added_tokens_decoder.items()}
    if _is_byte_level(tokenizer):
        byte_of = _byte_level_decoder()
        raw = tokenizer.convert_ids_to_tokens(list(range(size)))
        pieces = []
        for i, text in enumerate(raw):
            if i in added:
                pieces.append(added[i].encode("utf-8"))
            elif text is None:
                pieces.append(b"")
            else:
                try:
                    pieces.append(bytes(byte_of[ch] for ch in text))
                except KeyError:
                    pieces.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
        return pieces
    # Not byte-level (e.g. SentencePiece): decode each id once. Structure characters stay exact; a token that is
    # part of a multi-byte character decodes to U+FFFD here, so such text only round-trips as replacement chars.
    return [
        tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode("utf-8")
        for i in range(size)
    ]


@dataclass(frozen=True, eq=False)
class PieceTable:
    """Id -> decoded bytes for every id of one tokenizer, plus the re-encoding helpers of the prefix cut."""

    pieces: tuple[bytes, ...] = field(repr=False)
    lengths: np.ndarray = field(repr=False)
    stop_ids: frozenset[int]
    encode: Callable[[str], list[int]] = field(repr=False)
    encode_backend: Callable[[str], list[int]] | None = field(default=None, repr=False)
    _replacements: dict = field(default_factory=dict, repr=False)
    _segments: dict = field(default_factory=dict, repr=False)
    _flags: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "PieceTable":
        pieces = _build_pieces(tokenizer)
        vocab = tokenizer.get_vocab()
        stops = {int(vocab[t]) for t in _STOP_TOKENS if t in vocab}
        if getattr(tokenizer, "eos_token_id", None) is not None:
            stops.add(int(tokenizer.eos_token_id))
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        lengths.setflags(write=False)

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        backend = getattr(tokenizer, "backend_tokenizer", None)
        encode_backend = None
        if backend is not None:
            def encode_backend(text: str) -> list[int]:
                return backend.encode(text, add_special_tokens=False).ids

        return cls(pieces=tuple(pieces), lengths=lengths, stop_ids=frozenset(stops), encode=encode,
                   encode_backend=encode_backend)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "PieceTable":
        """The cached table of ``tokenizer``; rebuilt when tokens were added since (``len`` changed)."""
        key = id(tokenizer)
        entry = _CACHE.get(key)
        if entry is not None:
            ref, table = entry
            if ref() is tokenizer and len(table.pieces) == len(tokenizer):
                return table
        table = cls.from_tokenizer(tokenizer)
        try:
            ref = weakref.ref(tokenizer, lambda _r, key=key, cache=_CACHE: cache.pop(key, None))
        except TypeError:  # not weak-referenceable: keep it alive with the table
            ref = (lambda obj: (lambda: obj))(tokenizer)
        _CACHE[key] = (ref, table)
        return table

    @property
    def is_stop(self) -> np.ndarray:
        """Boolean ``(len(pieces),)``: whether each id is a stop token (one gather finds them in a rollout)."""
        mask = self._flags.get(("is_stop",))
        if mask is None:
            mask = np.zeros(len(self.pieces), dtype=bool)
            mask[[i for i in self.stop_ids if 0 <= i < len(self.pieces)]] = True
            mask.setflags(write=False)
            self._flags[("is_stop",)] = mask
        return mask

    def bins_table(self, vocab: Any) -> np.ndarray:
        """int32 ``(len(pieces),)``: the coord bin of every id under ``vocab`` (a CoordVocab), -1 for other ids."""
        cached = self._flags.get(("bins_table",))
        if cached is not None and cached[0] is vocab:
            return cached[1]
        bins = np.full(len(self.pieces), -1, dtype=np.int32)
        lookup = vocab.lookup[: len(self.pieces)]
        bins[: len(lookup)] = lookup
        bins.setflags(write=False)
        self._flags[("bins_table",)] = (vocab, bins)  # holds the vocab, so its id is never reused while cached
        return bins

    def text_of_array(self, ids: np.ndarray, starts: np.ndarray) -> bytes:
        """:meth:`text_of` for an id array in range, given ``starts`` (its pieces' byte offsets, ``T + 1``): one
        gather from all pieces laid end to end, instead of one Python object per token."""
        blob = self._flags.get(("blob",))
        if blob is None:
            offsets = np.zeros(len(self.pieces), dtype=np.int64)
            np.cumsum(self.lengths[:-1], out=offsets[1:])
            blob = self._flags[("blob",)] = (np.frombuffer(b"".join(self.pieces), dtype=np.uint8), offsets)
        data, offsets = blob
        shift = np.repeat(offsets[ids] - starts[:-1], self.lengths[ids])
        shift += np.arange(len(shift))
        return data[shift].tobytes()

    def text_of(self, ids: Sequence[int]) -> bytes:
        """The exact decoded bytes of ``ids`` (special tokens included, no cleanup)."""
        pieces = self.pieces
        try:
            return b"".join(itemgetter(*ids)(pieces)) if len(ids) > 1 else b"".join([pieces[i] for i in ids])
        except IndexError:
            bad = [int(i) for i in ids if not 0 <= int(i) < len(pieces)]
            raise ValueError(f"token ids {bad[:5]} are outside the tokenizer's {len(pieces)} ids") from None

    def reencode(self, text: bytes) -> tuple[int, ...] | None:
        """Ids whose pieces concatenate to exactly ``text``, or None when the tokenizer cannot express it."""
        cached = self._replacements.get(text)
        if cached is not None or text in self._replacements:
            return cached
        result: tuple[int, ...] | None
        try:
            decoded = text.decode("utf-8")
        except UnicodeDecodeError:
            result = None
        else:
            ids = tuple(self.encode(decoded))
            result = ids if ids and self.text_of(ids) == text else None
        if len(self._replacements) < 65536:
            self._replacements[text] = result
        return result

    def encode_segment(self, text: str) -> tuple[int, ...]:
        """Cached encoding of a text holding no added token (e.g. the JSON between two coord tokens).

        An object key's number is encoded on its own where the tokenizer splits there anyway
        (:meth:`splits_at_object_numbers`), so the text around it is shared by every object number.
        """
        ids = self._segments.get(text)
        if ids is None:
            number = _OBJECT_NUMBER_RE.search(text) if '"object_' in text else None
            if number is not None and self.splits_at_object_numbers():
                lo, hi = number.span(1)  # each part is checked to round-trip, so their concatenation is too
                ids = self.encode_segment(text[:lo]) + self.encode_segment(text[lo:hi]) + self.encode_segment(text[hi:])
            else:
                encode = self.encode_backend if self._flags.get("backend_matches") else self.encode
                ids = tuple(encode(text)) if text else ()
                if self.text_of(ids) != text.encode("utf-8"):
                    raise ValueError(f"the tokenizer does not round-trip {text[:60]!r} (decode(encode(text)) != text)")
            if len(self._segments) >= 200_000:
                self._segments.clear()
            self._segments[text] = ids
        return ids

    def splits_at_object_numbers(self) -> bool:
        """Whether encoding ``..."object_<digits>": {...`` equals encoding the text before the digits, the digits
        and the text after them separately (true where the pre-tokenizer isolates digits, as Qwen2's does).

        Checked once on probes around every digit count and the contexts a rendered key appears in.
        """
        cached = self._flags.get(("object_numbers",))
        if cached is None:
            cached = True
            for before in ('"object_', ', "object_', '"]}, "object_', '"], "desc": "a b"}, "object_', '{"object_'):
                for number in ("1", "7", "42", "305", "1000", "99999"):
                    for after in ('": {"desc": "a b", "poly": ["', '": {"bbox_2d": ["', '": {"desc": "1 x"'):
                        whole = self.encode(before + number + after)
                        if whole != self.encode(before) + self.encode(number) + self.encode(after):
                            cached = False
            self._flags[("object_numbers",)] = cached
        return cached

    def encode_joined(self, segments: Sequence[str], separator_ids: Sequence[int]) -> tuple[int, ...]:
        """``segments[0] + sep[0] + segments[1] + ... + segments[-1]`` from cached segment encodings."""
        cache = self._segments
        if len(separator_ids) != len(segments) - 1:  # not one separator between each two segments: zip's pairing
            ids: list[int] = []
            for segment, separator in zip(segments, separator_ids):
                cached = cache.get(segment)
                ids.extend(cached if cached is not None else self.encode_segment(segment))
                ids.append(separator)
            ids.extend(self.encode_segment(segments[-1]))
            return tuple(ids)
        encoded = [cache.get(segment) for segment in segments]
        if None in encoded:
            encoded = [ids if ids is not None else self.encode_segment(s) for ids, s in zip(encoded, segments)]
        joined = list(encoded[0])
        for separator, ids in zip(separator_ids, encoded[1:]):
            joined.append(separator)
            joined += ids
        return tuple(joined)

    def splits_at_added_tokens(self, added_token_text: str) -> bool:
        """Whether encoding text around ``added_token_text`` equals encoding the pieces on either side separately.

        True for Hugging Face added tokens that are not normalized and strip nothing (how coord tokens are added);
        checked once on a probe so the segment cache is never used where it would change the tokenization.
        """
        cached = self._flags.get(added_token_text)
        if cached is None:
            left, right = '{"object_1": {"desc": "a b", "bbox_2d": ["', '", 7, x]}, "poly": [ '
            whole = self.encode(left + added_token_text + right)
            single = self.encode(added_token_text)
            cached = len(single) == 1 and whole == self.encode(left) + single + self.encode(right)
            self._flags[added_token_text] = cached
            # the raw backend skips the Python wrapper (~10 us per call); use it only where it gives the same ids
            if self.encode_backend is not None:
                self._flags["backend_matches"] = all(
                    list(self.encode_backend(t)) == self.encode(t) for t in (left, right, left + added_token_text)
                )
        return cached

    def open_brace_ids(self) -> tuple[int, ...]:
        """Ids of the empty prefix ``{`` (the fallback prefix of docs/design.md, decision 3)."""
        ids = self.reencode(b"{")
        if ids is None:
            raise ValueError("the tokenizer cannot encode '{' so that it decodes back to '{'; it cannot serve JSON output")
        return ids


_CACHE: dict[int, tuple[Callable[[], Any], PieceTable]] = {}

"""Who may use coordexp's weight-sync rendezvous store, and what may be read from it (docs/design.md#ms310).

A ``TCPStore`` has no authentication: anyone who can reach its port can read and write any key. Two rules keep that
from mattering on coordexp's wire:

- **a per-init key**: the server draws a fresh random ``rendezvous_key`` on every authorized
  ``/init_communicator/`` and answers it to that caller only; both ends then keep every store key under
  ``coordexp_weight_sync/<key>/`` (:func:`store_prefix`). The store cannot list its keys, so a client that did not
  pass the HTTP guard can neither read the group's addresses (or the NCCL unique id) nor write what the ranks read;
- **checked values**: gloo parses a peer's rendezvous record (``<context>/<rank>``: host name, device address, pair
  ids) with no bounds checks, so an empty value used to crash the whole server with SIGSEGV. Every such record is
  parsed here first (:func:`parse_gloo_rank`) and must have exactly the shape of this rank's own record; anything
  else is a :class:`~coordexp.runtime.rollout.weight_sync.WeightSyncError` before gloo sees it
  (:class:`GlooRendezvousGuard`).
"""

from __future__ import annotations

import re
import secrets
import socket
import struct
from dataclasses import dataclass

import torch.distributed as dist

from coordexp.runtime.rollout.sync_errors import WeightSyncError

__all__ = ["STORE_PREFIX", "KEY_PATTERN", "MAX_RECORD_BYTES", "StoreRecordError", "new_rendezvous_key",
           "store_prefix", "GlooRank", "parse_gloo_rank", "GlooRendezvousGuard"]

STORE_PREFIX = "coordexp_weight_sync"
KEY_PATTERN = re.compile(r"[0-9a-f]{32,128}")
MAX_RECORD_BYTES = 64 * 1024  # a gloo rendezvous record is ~170 bytes per rank
_MAX_HOSTNAME_BYTES = 1024
_SIZE = struct.Struct("=Q")  # gloo writes size_t fields in this machine's byte order
_FAMILY = struct.Struct("=H")  # sa_family_t, the first field of the sockaddr inside the device address
_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_RANK_KEY = re.compile(r"(\d{1,9})/(\d{1,9})")


class StoreRecordError(WeightSyncError):
    """A value read from the rendezvous store is malformed or does not fit this group (refused before use)."""


def new_rendezvous_key() -> str:
    """A fresh per-init secret (128 random bits, hex) that both ends put in front of every store key."""
    return secrets.token_hex(16)


def store_prefix(rendezvous_key: str | None) -> str:
    """The store prefix of a group: ``coordexp_weight_sync/<key>`` (or the bare prefix for a keyless pair, which a
    coordexp server never forms). A malformed key is refused: it comes from the network."""
    if rendezvous_key is None:
        return STORE_PREFIX
    if not isinstance(rendezvous_key, str) or not KEY_PATTERN.fullmatch(rendezvous_key):
        raise WeightSyncError("the server's rendezvous_key is malformed (expected 32-128 lowercase hex digits)",
                              hint="use the rendezvous_key of this server's /init_communicator/ reply unchanged")
    return f"{STORE_PREFIX}/{rendezvous_key}"


@dataclass(frozen=True)
class GlooRank:
    """One parsed gloo rendezvous record: who the peer says it is and where its device listens."""

    hostname: bytes
    address_size: int
    family: int
    pair_ids: tuple[int, ...]


def parse_gloo_rank(value: bytes) -> GlooRank:
    """Parse gloo's ``Rank`` record (``size_t`` host-name length, host name, ``size_t`` address length, the device
    address (a ``sockaddr_storage`` then its sequence number), then one ``ssize_t`` pair id per rank to the end),
    every length checked against the bytes actually there; raises :class:`WeightSyncError` on any other shape."""
    data = bytes(value)
    if not 0 < len(data) <= MAX_RECORD_BYTES:
        raise StoreRecordError(f"a weight-sync rendezvous record is {len(data)} bytes (expected 1..{MAX_RECORD_BYTES})")
    offset = 0

    def size_field(what: str, limit: int) -> int:
        nonlocal offset
        if offset + _SIZE.size > len(data):
            raise StoreRecordError(f"a weight-sync rendezvous record ends before its {what}")
        (number,) = _SIZE.unpack_from(data, offset)
        offset += _SIZE.size
        if number > limit or offset + number > len(data):
            raise StoreRecordError(f"a weight-sync rendezvous record's {what} ({number}) overruns the record "
                                  f"({len(data)} bytes)")
        return number

    hostname_size = size_field("host-name length", _MAX_HOSTNAME_BYTES)
    hostname = data[offset:offset + hostname_size]
    offset += hostname_size
    address_size = size_field("address length", 1024)
    if address_size < _FAMILY.size + _SIZE.size:
        raise StoreRecordError(f"a weight-sync rendezvous record's device address is {address_size} bytes, too short "
                              "for a socket address")
    (family,) = _FAMILY.unpack_from(data, offset)
    if family not in _FAMILIES:
        raise StoreRecordError(f"a weight-sync rendezvous record's device address has socket family {family} "
                              "(expected IPv4 or IPv6)")
    offset += address_size
    rest = len(data) - offset
    if rest % _SIZE.size:
        raise StoreRecordError(f"a weight-sync rendezvous record's pair ids are {rest} bytes, not whole 8-byte ids")
    pair_ids = tuple(_SIZE.unpack_from(data, offset + k)[0] for k in range(0, rest, _SIZE.size))
    return GlooRank(hostname, address_size, family, pair_ids)


class GlooRendezvousGuard(dist.Store):
    """The store gloo sees: every call goes to ``inner``; a peer's rendezvous record (``<context>/<rank>``) is
    returned only when it parses and matches this rank's own record (address size and family, as many pair
    ids), else :class:`WeightSyncError` reaches the caller of ``ProcessGroupGloo`` instead of a crash."""

    def __init__(self, inner: dist.Store, rank: int, world_size: int):
        super().__init__()
        self.inner, self.rank, self.world_size = inner, rank, world_size
        self._own: GlooRank | None = None

    def _check(self, key: str, value: bytes) -> bytes:
        match = _RANK_KEY.fullmatch(key)
        if match is None:
            return value
        rank = int(match.group(2))
        if not 0 <= rank < self.world_size:
            raise StoreRecordError(f"the weight-sync rendezvous asked for rank {rank} of {self.world_size}")
        record = parse_gloo_rank(value)
        if rank == self.rank:
            self._own = record
            return value
        own = self._own if self._own is not None else parse_gloo_rank(self.inner.get(f"{match.group(1)}/{self.rank}"))
        shape, expected = ((record.address_size, record.family, len(record.pair_ids)),
                           (own.address_size, own.family, len(own.pair_ids)))
        if shape != expected:
            raise StoreRecordError(f"rank {rank}'s weight-sync rendezvous record does not match this end's (address "
                                  f"bytes, socket family, pair ids: {shape}; expected {expected})")
        return value

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        if _RANK_KEY.fullmatch(key) and int(key.split("/")[1]) == self.rank:
            try:  # this torch's own record: the shape every peer's must have
                self._own = parse_gloo_rank(data)
            except WeightSyncError as exc:
                raise StoreRecordError(f"this torch's own gloo rendezvous record is not in the format coordexp checks "
                                      f"({exc}); weight sync refuses to run unchecked",
                                      hint="use the torch version pinned by coordexp, or update store_guard") from None
        self.inner.set(key, data)

    def get(self, key: str) -> bytes:
        return self._check(key, self.inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout=None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self.inner.set_timeout(timeout)

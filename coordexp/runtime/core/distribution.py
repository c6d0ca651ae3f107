"""Pure arithmetic of server-mode rollouts: topology feasibility, per-rank chunk, request split across servers, seeds.

Split rule (docs/design.md, server mode: reconciles ``chunk_size = ceil(N / S)`` with "proportional to world sizes"):
server ``i`` with world size ``w_i`` may take at most ``ceil(N * w_i / sum(w))`` requests, and servers are filled in
order with contiguous slices. With equal world sizes this is exactly ``ceil(N / S)`` contiguous chunks (trailing
servers may get zero); with unequal ones no server gets more than its proportional share rounded up.

Rank-aware capacity (``rank_allotment``): the ``decode_batch_size x sum(w)`` request slots of all servers are laid
out in server order and learner rank ``r`` owns slots ``[r * chunk, (r + 1) * chunk)``. Each rank splits its
requests over the servers in proportion to the slots it owns there, so the ranks' shares are disjoint and the
concurrent load on server ``i`` never exceeds ``decode_batch_size x w_i`` (see docs/design.md, server mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from coordexp.errors import ExternalSystemError

__all__ = [
    "SEED_MASK",
    "InfeasibleTopologyError",
    "ServerSlice",
    "normalize_seed",
    "rollout_seed",
    "eval_rollout_seed",
    "train_request_seeds",
    "global_request_index",
    "EVAL_STREAM_OFFSET",
    "per_rank_chunk",
    "rank_allotment",
    "split_contiguous",
    "plan_rounds",
    "consecutive_seed_runs",
    "is_gt_step",
]

SEED_MASK = 0x7FFFFFFF
STEP_STRIDE = 1_000_003  # a prime, so (step, index) pairs of nearby steps do not collide
EVAL_STREAM_OFFSET = 1 << 30  # evaluation indices start here: disjoint from any step's training indices


class InfeasibleTopologyError(ExternalSystemError, ValueError):
    """``decode_batch_size * sum(server world sizes) < learner world size``: some rank could not send a request."""


@dataclass(frozen=True)
class ServerSlice:
    """Requests ``[start, stop)`` (positions in the caller's list) go to server number ``server``."""

    server: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def normalize_seed(value: int) -> int:
    """Map any integer into ``1..2**31-1`` (ms-swift treats seed 0 as "unset", so 0 is never sent): the identity on
    that range, otherwise modulo ``2**31 - 1``, so any ``2**31 - 1`` consecutive integers get distinct seeds (the old
    ``(v & mask) or 1`` gave 0 and 1 the same seed: seed 0's first two requests sampled alike)."""
    return (int(value) - 1) % SEED_MASK + 1


def global_request_index(micro_step: int, rank: int, world_size: int, per_rank: int, index: int) -> int:
    """The position of a request among all requests of one optimizer step (micro-step major, then rank).
    ``micro_step`` counts from 0 within the optimizer step, so the position does not depend on how the run got to
    that step (fresh or resumed)."""
    return (int(micro_step) * int(world_size) + int(rank)) * int(per_rank) + int(index)


def rollout_seed(training_seed: int, global_step: int, request_index: int) -> int:
    """The seed of one request, a pure function of (training seed, global step, index within the step; the index
    encodes the micro-step within the step, rank and position, see :func:`global_request_index`). Consecutive indices give consecutive seeds (a server
    call carries one base seed, request ``j`` gets ``seed + j``)."""
    return normalize_seed(int(training_seed) + int(global_step) * STEP_STRIDE + int(request_index))


def train_request_seeds(training_seed: int, global_step: int, micro_step: int, rank: int, world_size: int,
                        per_rank: int, count: int) -> list[int]:
    """The seeds of one rank's ``count`` training rollouts in micro-step ``micro_step`` (0-based within the optimizer
    step) of ``global_step``: a pure function of (seed, step, micro-step, rank, index), identical after a resume."""
    if count > per_rank:
        raise ValueError(f"{count} requests exceed the per-rank stride {per_rank}; seeds would collide across ranks")
    base = global_request_index(micro_step, rank, world_size, per_rank, 0)
    return [rollout_seed(training_seed, global_step, base + i) for i in range(int(count))]


def eval_rollout_seed(training_seed: int, global_step: int, record_index: int) -> int:
    """The seed of evaluation rollout ``record_index`` (the record's position in the evaluation set) at
    ``global_step``: its own stream, offset by :data:`EVAL_STREAM_OFFSET`, so an evaluation never reuses the seeds of
    the training rollouts of that step, and a record's seed does not depend on how the set is sharded over ranks."""
    return rollout_seed(training_seed, global_step, EVAL_STREAM_OFFSET + int(record_index))


def per_rank_chunk(decode_batch_size: int, server_world_sizes: Sequence[int], learner_world_size: int) -> int:
    """``floor(decode_batch_size * S / W)``: how many requests one learner rank sends at once (``S`` = total server
    world size), so that all ranks together never exceed ``decode_batch_size`` per rollout GPU.

    Raises :class:`InfeasibleTopologyError` with the three fixes when ``decode_batch_size * S < W``.
    """
    if decode_batch_size < 1:
        raise ValueError(f"decode_batch_size must be >= 1, got {decode_batch_size}")
    if learner_world_size < 1:
        raise ValueError(f"learner world size must be >= 1, got {learner_world_size}")
    if not server_world_sizes or any(int(w) < 1 for w in server_world_sizes):
        raise ValueError(f"every server must report a world size >= 1, got {list(server_world_sizes)}")
    total = sum(int(w) for w in server_world_sizes)
    if decode_batch_size * total < learner_world_size:
        raise InfeasibleTopologyError(
            f"decode_batch_size cap is infeasible for this topology: decode_batch_size ({decode_batch_size}) * "
            f"total server world size ({total}, per server {list(server_world_sizes)}) = {decode_batch_size * total} "
            f"< learner world size ({learner_world_size}), so some learner rank could not send a single request. "
            "Increase the rollout server world size (more data-parallel replicas or servers), reduce the learner "
            "world size (fewer torchrun processes), or increase rollout_matching.decode_batch_size.")
    return (decode_batch_size * total) // learner_world_size


def rank_allotment(decode_batch_size: int, server_world_sizes: Sequence[int], learner_world_size: int,
                   rank: int) -> list[int]:
    """How many of learner rank ``rank``'s concurrent requests each server may take (module doc): the rank's
    ``per_rank_chunk`` slots, counted per server. Allotments of different ranks never share a slot."""
    chunk = per_rank_chunk(decode_batch_size, server_world_sizes, learner_world_size)
    if not 0 <= rank < learner_world_size:
        raise ValueError(f"rank must be in [0, {learner_world_size}), got {rank}")
    first, stop = rank * chunk, (rank + 1) * chunk
    allotment = []
    begin = 0
    for size in server_world_sizes:
        end = begin + decode_batch_size * int(size)
        allotment.append(max(0, min(stop, end) - max(first, begin)))
        begin = end
    return allotment


def split_contiguous(n: int, server_world_sizes: Sequence[int]) -> list[ServerSlice]:
    """Contiguous, order-preserving slices of ``n`` requests over the servers, capacity-proportional (module doc).

    A weight may be 0 (a server outside this rank's allotment gets nothing). Returns only non-empty slices, in server
    order; ``n == 0`` gives ``[]`` (nothing is sent).
    """
    if n < 0:
        raise ValueError(f"request count must be >= 0, got {n}")
    weights = [int(w) for w in server_world_sizes]
    if not weights or any(w < 0 for w in weights) or sum(weights) < 1:
        raise ValueError(f"server weights must be >= 0 with at least one >= 1, got {weights}")
    total = sum(weights)
    slices: list[ServerSlice] = []
    start = 0
    for server, weight in enumerate(weights):
        if start >= n:
            break
        if weight == 0:
            continue
        capacity = -(-n * weight // total)  # ceil(n * w / total)
        stop = min(n, start + capacity)
        slices.append(ServerSlice(server, start, stop))
        start = stop
    return slices


def plan_rounds(n: int, chunk: int, server_world_sizes: Sequence[int]) -> list[list[ServerSlice]]:
    """Rounds of at most ``chunk`` requests (in order), each split over the servers with :func:`split_contiguous`.
    Slice positions are absolute (into the full list of ``n``)."""
    if chunk < 1:
        raise ValueError(f"per-rank chunk must be >= 1, got {chunk}")
    rounds: list[list[ServerSlice]] = []
    for begin in range(0, n, chunk):
        size = min(chunk, n - begin)
        rounds.append([ServerSlice(s.server, begin + s.start, begin + s.stop)
                       for s in split_contiguous(size, server_world_sizes)])
    return rounds


def consecutive_seed_runs(seeds: Sequence[int], start: int, stop: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` where ``seeds[k + 1] != seeds[k] + 1``: one ``/infer/`` call carries one base seed
    and the server gives request ``j`` of the call ``seed + j``, so each call must cover consecutive seeds."""
    runs: list[tuple[int, int]] = []
    begin = start
    for k in range(start + 1, stop):
        if int(seeds[k]) != int(seeds[k - 1]) + 1:
            runs.append((begin, k))
            begin = k
    if stop > start:
        runs.append((begin, stop))
    return runs


def is_gt_step(global_step: int, share: float) -> bool:
    """Whether optimizer step ``global_step`` trains the ground-truth serialization instead of rollouts
    (``rollout_matching.gt_step_share``): steps ``k`` with ``floor((k + 1) * share) > floor(k * share)``, so the first
    ``n`` steps hold exactly ``floor(n * share)`` of them, evenly spread, and a resumed run picks the same steps."""
    if share <= 0:
        return False
    exact = Fraction(share).limit_denominator(1_000_000)
    return (global_step + 1) * exact.numerator // exact.denominator > global_step * exact.numerator // exact.denominator

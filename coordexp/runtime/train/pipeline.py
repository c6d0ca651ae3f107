"""The stage-2 micro-step pipeline: one owner for the plan, seeds, rollouts, the weight-sync point, the carry buffer
and sample age (docs/design.md, decision 14). It needs no HF ``Trainer``: the trainer hands it records and the global
step, and gets back the forward rows of the micro-step.

Invariants it keeps:
- **One weight-sync point per optimizer step**, decided from the global step: the first rollout of step ``k``
  (training or evaluation, whichever comes first) pushes the weights; later rollouts of ``k`` never do. Every rank
  reaches it at the same call, so the backend's collectives pair up however the ranks' evaluation shards divide.
- **Every sample knows its age**: outputs and samples carry the policy version (optimizer steps applied) that
  generated them; staleness is measured when a sample trains, and carried segments older than
  ``overlap.staleness`` optimizer steps are dropped (counted in ``rollout/stale_dropped``).
- **Prompts are encoded once** per sample, also when the rollouts were prefetched; evaluation goes through the same
  roll-out path (:func:`iter_rollout_samples`) as ``coordexp eval``.
- **No tail prefetch**: the lookahead stops at ``max_steps``.
- **Whole-step rollout batches**: the micro-steps of one optimizer step share its weights, so the micro-steps the
  trainer planned (:meth:`MicroStepPipeline.plan`) are rolled out at the step's sync point in ONE backend call (a
  server or colocate engine sees ``gradient_accumulation_steps x batch`` prompts), each with the seeds it draws on
  its own (:meth:`MicroStepPipeline.request_seeds`), so outputs do not change; with overlap the prefetch unit is the
  rest of the step (or the next step's first micro-step), at the same policy versions as one micro-step at a time.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from coordexp.runtime.core.distribution import eval_rollout_seed, is_gt_step, train_request_seeds
from coordexp.runtime.core.packing import CarryBuffer
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.weight_export import full_parameters
from coordexp.runtime.train.metrics import StepStats
from coordexp.runtime.train.overlap import PlannedMicroStep, RolloutPrefetcher, generate_with_metadata
from coordexp.runtime.train.reward_step import build_reward_samples
from coordexp.runtime.train.rollout_step import (
    HostContext,
    SampleTarget,
    build_gt_sample,
    build_rollout_sample,
    label_draft_ids,
)
from coordexp.runtime.train.run_log import step_records_hash
from coordexp.runtime.train.visualize import append_rollout_log

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.model.encoding import EncodedPrompt
    from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput
    from coordexp.runtime.train.run_log import RunLog
    from coordexp.schema.contract import RunContract

__all__ = ["PipelineSettings", "RolledOut", "RolloutChunk", "iter_rollout_samples", "MicroStepPipeline"]

logger = logging.getLogger("coordexp.train.pipeline")


@dataclass(frozen=True)
class PipelineSettings:
    """The run's shape as the pipeline needs it (from the contract and the resolved ``TrainingArguments``)."""

    seed: int
    rank: int = 0
    world_size: int = 1
    per_device_batch: int = 1
    decode_batch_size: int = 1
    stage2: bool = True
    overlap: bool = False
    staleness_bound: int = 1
    packing_length: int | None = None  # None: packing off
    packing_buffer: int = 0
    min_fill_ratio: float = 0.0
    max_steps: int = -1  # <= 0: not known (epochs)
    rollout_log_dir: str | None = None  # where rank 0 appends rollouts.jsonl; None: not this rank
    rollout_log_every: int = 0
    gt_step_share: float = 0.0  # stage 2: share of optimizer steps trained on the GT serialization (no rollout)
    reward_group: int = 0  # objective: reward: rollouts per image (group_size, + 1 greedy); 0: rollout-matching SFT
    greedy_member: bool = False  # the last rollout of each reward group is decoded greedily (reward.include_greedy)
    greedy_eval: bool = False  # evaluation rollouts are decoded greedily although training samples (reward, hf)

    @classmethod
    def of(cls, run: "RunContract", args: Any, *, rollout_log_every: int = 0) -> "PipelineSettings":
        rm = run.rollout_matching
        stage2 = run.trainer_variant == "stage2_rollout_aligned"
        return cls(
            seed=int(args.seed), rank=int(args.process_index), world_size=max(1, int(args.world_size)),
            per_device_batch=int(args.per_device_train_batch_size), decode_batch_size=int(rm.decode_batch_size),
            stage2=stage2, overlap=stage2 and rm.overlap.enabled, staleness_bound=int(rm.overlap.staleness),
            packing_length=rm.packing.packing_length if rm.packing.enabled else None,
            packing_buffer=int(rm.packing.buffer), min_fill_ratio=float(rm.packing.min_fill_ratio),
            max_steps=int(args.max_steps), rollout_log_dir=str(args.output_dir) if args.process_index == 0 else None,
            rollout_log_every=int(rollout_log_every), gt_step_share=float(rm.gt_step_share) if stage2 else 0.0,
            **cls.reward_shape(rm, stage2),
        )

    @staticmethod
    def reward_shape(rm: Any, stage2: bool) -> dict[str, Any]:
        """The reward objective's fields (none for rollout-matching SFT or stage 1)."""
        if not stage2 or rm.objective != "reward":
            return {}
        greedy = bool(rm.reward.include_greedy)
        return {"reward_group": int(rm.reward.group_size) + int(greedy), "greedy_member": greedy,
                "greedy_eval": rm.greedy_evaluation}

    def expand(self, records: Sequence[Any]) -> list[Any]:
        """The rollout requests of ``records``: each record ``reward_group`` times in a row under the reward
        objective (one image's group), else once."""
        return [r for r in records for _ in range(self.reward_group)] if self.reward_group else list(records)

    def rolls_out(self, step: int) -> bool:
        """Whether optimizer step ``step`` trains rollouts (stage 2 and not one of the ground-truth steps)."""
        return self.stage2 and not is_gt_step(step, self.gt_step_share)


@dataclass(frozen=True)
class RolledOut:
    """One micro-step's share of a backend call that rolled out several: what was asked and what came back."""

    key: tuple[int, int]
    records: tuple["DetectionRecord", ...]
    seeds: tuple[int, ...]
    prompts: tuple["EncodedPrompt", ...]
    outputs: tuple["RolloutOutput", ...] = ()
    metadata: dict[str, Any] | None = None
    version: int | None = None

    def is_for(self, key: tuple[int, int], records: Sequence[Any], seeds: Sequence[int]) -> bool:
        """Whether this is micro-step ``key``'s share for exactly these records and seeds (the plan held)."""
        return self.key == key and len(self.records) == len(records) and all(
            a is b for a, b in zip(self.records, records)) and list(self.seeds) == [int(x) for x in seeds]


@dataclass(frozen=True)
class RolloutChunk:
    """One backend call's worth of rolled-out records: prompts, outputs, built samples and the call's metadata."""

    records: list["DetectionRecord"]
    seeds: list[int]
    outputs: list["RolloutOutput"]
    samples: list[SampleTarget]
    metadata: dict[str, Any]
    seconds: float


def encode_prompts(host: HostContext, records: Sequence["DetectionRecord"]) -> list["EncodedPrompt"]:
    return [encode_prompt(host.processor, r, host.template) for r in records]


def _requests(records: Sequence["DetectionRecord"], prompts: Sequence["EncodedPrompt"], seeds: Sequence[int],
              host: HostContext, greedy_every: int = 0, greedy: bool = False) -> list[RolloutRequest]:
    """One request per record, carrying its ground truth as a decoding draft where the run uses label drafts. With
    ``greedy_every = n``, every n-th request (the last of each reward group) is decoded greedily; with ``greedy``,
    all of them."""
    return [RolloutRequest(prompt=p, index=i, seed=int(s), record=r, draft_token_ids=label_draft_ids(r, host),
                           greedy=greedy or (greedy_every > 0 and i % greedy_every == greedy_every - 1))
            for i, (r, p, s) in enumerate(zip(records, prompts, seeds, strict=True))]


def _group_requests(group: Sequence[RolledOut], host: HostContext, greedy_every: int = 0) -> list[RolloutRequest]:
    """One backend call's requests for several micro-steps, in micro-step order."""
    return _requests([r for part in group for r in part.records], [p for part in group for p in part.prompts],
                     [s for part in group for s in part.seeds], host, greedy_every)


def _split(group: Sequence[RolledOut], outputs: Sequence["RolloutOutput"], metadata: dict[str, Any],
           version: int) -> list[RolledOut]:
    """The call's outputs handed back to the micro-steps they belong to."""
    parts, start = [], 0
    for part in group:
        stop = start + len(part.records)
        parts.append(replace(part, outputs=tuple(outputs[start:stop]), metadata=metadata, version=version))
        start = stop
    if start != len(outputs):
        raise RuntimeError(f"the rollout backend returned {len(outputs)} outputs for {start} requests")
    return parts


def _samples(records, prompts, outputs, host: HostContext, version: int | None) -> list[SampleTarget]:
    return [replace(build_rollout_sample(r, p, o, host), policy_version=version)
            for r, p, o in zip(records, prompts, outputs, strict=True)]


def iter_rollout_samples(backend: "RolloutBackend", host: HostContext, records: Sequence["DetectionRecord"],
                         seeds: Sequence[int], *, chunk: int, policy_version: int | None = None, greedy: bool = False
                         ) -> Iterator[RolloutChunk]:
    """Roll ``records`` out ``chunk`` at a time with one seed each (the weights are whatever the backend holds) and
    build every sample as rollout-matching SFT does; chunks are yielded so a caller can score and drop them (bounded
    memory). ``greedy``: every request decoded greedily (the reward objective's evaluation, which trains sampling)."""
    if len(seeds) != len(records):
        raise ValueError(f"{len(records)} records but {len(seeds)} seeds")
    step = max(1, int(chunk))
    for start in range(0, len(records), step):
        part, part_seeds = list(records[start:start + step]), [int(s) for s in seeds[start:start + step]]
        prompts = encode_prompts(host, part)
        outputs, metadata, seconds = generate_with_metadata(backend, _requests(part, prompts, part_seeds, host,
                                                                               greedy=greedy))
        outputs = [replace(o, policy_version=policy_version) for o in outputs]
        yield RolloutChunk(part, part_seeds, outputs, _samples(part, prompts, outputs, host, policy_version),
                           metadata, seconds)


class MicroStepPipeline:
    """Per micro-step: seeds -> (prefetched or fresh) rollouts after the step's one weight-sync point -> samples ->
    carry buffer and staleness -> forward rows. ``policy()`` returns the unwrapped model to push."""

    def __init__(self, host: HostContext, backend: "RolloutBackend | None", settings: PipelineSettings, *,
                 stats: StepStats, run_log: "RunLog", policy: Callable[[], Any]):
        if settings.stage2 and backend is None:
            raise ValueError("stage2_rollout_aligned needs a rollout backend (rollout_matching.rollout_backend)")
        self.host = host
        self.settings = settings
        self.stats = stats
        self.run_log = run_log
        self.policy = policy
        self.buffer: CarryBuffer | None = (CarryBuffer(settings.packing_length, settings.packing_buffer)
                                           if settings.packing_length is not None else None)
        self.backend = backend
        # (global step, training micro-steps rolled out in it): seeds depend on the micro-step WITHIN the optimizer
        # step, so a run resumed at step k draws what the uninterrupted run drew
        self.micro_step: tuple[int, int] = (-1, 0)
        self.sync_points: list[int] = []  # the global steps whose weights were pushed, in order
        self._planned: list[PlannedMicroStep] = []
        self._rolled: dict[tuple[int, int], RolledOut] = {}  # micro-steps rolled out ahead by a whole-step call
        self._in_flight: list[RolledOut] = []  # the micro-steps of the prefetch in flight (keyed by the first)
        self._fill_advised = False
        self._calls_advised = False

    @property
    def backend(self) -> "RolloutBackend | None":
        return self._backend

    @backend.setter
    def backend(self, backend: "RolloutBackend | None") -> None:
        self._backend = backend
        self.prefetcher = RolloutPrefetcher(backend) if self.settings.overlap and backend is not None else None

    # -- plan --------------------------------------------------------------------------------------------------
    def wants_lookahead(self, step: int) -> bool:
        """Whether to read the next optimizer step's first micro-batch now (overlap only, never past ``max_steps``)."""
        return self.prefetcher is not None and (self.settings.max_steps <= 0 or step + 1 < self.settings.max_steps)

    def plan(self, step: int, batches: Sequence[Sequence[Any]], following: Sequence[Any] | None) -> None:
        """The micro-steps of optimizer step ``step`` (and the next step's first, when looked ahead)."""
        self._planned = [PlannedMicroStep((step, i), tuple(self.settings.expand(b))) for i, b in enumerate(batches)]
        # which records this step trains, so two runs' data order can be compared step for step (bench_learning)
        self.run_log.write("step_records", global_step=int(step), records=sum(len(b) for b in batches),
                           hash=step_records_hash(batches))
        if following is not None:
            self._planned.append(PlannedMicroStep((step + 1, 0), tuple(self.settings.expand(following))))

    # -- seeds -------------------------------------------------------------------------------------------------
    def request_seeds(self, step: int, micro: int, count: int) -> list[int]:
        """This rank's ``count`` seeds for micro-step ``micro`` of optimizer step ``step`` (:func:`train_request_seeds`)."""
        s = self.settings
        stride = max(s.per_device_batch, count)
        return train_request_seeds(s.seed, step, micro, s.rank, s.world_size, stride, count)

    @property
    def _greedy_every(self) -> int:
        """Every how many requests one is decoded greedily (the last of each reward group), 0: none."""
        return self.settings.reward_group if self.settings.greedy_member else 0

    def next_micro_step(self, step: int) -> int:
        owner, drawn = self.micro_step
        micro = drawn if owner == step else 0
        self.micro_step = (step, micro + 1)
        return micro

    # -- the weight-sync point ---------------------------------------------------------------------------------
    def sync_point(self, step: int) -> None:
        """Push the policy's weights once per optimizer step (the first rollout of ``step``); nothing may be
        generating meanwhile, so an in-flight prefetch is waited for (its result stays available)."""
        if self.backend is None or (self.sync_points and self.sync_points[-1] == step):
            return
        if self.prefetcher is not None:
            self.prefetcher.wait()
        self.backend.begin_step(step)
        with full_parameters(self.policy()) as policy:  # ZeRO-3: gathered on every rank here, else a no-op
            self.backend.sync_weights(policy)
        self.sync_points.append(step)

    # -- training ----------------------------------------------------------------------------------------------
    def samples(self, records: Sequence["DetectionRecord"], step: int) -> list[SampleTarget]:
        """This micro-step's per-sample targets: rollouts (stage 2) or the GT serialization (stage 1, and the
        ground-truth steps of stage 2: ``rollout_matching.gt_step_share``, docs/design.md, decision 15)."""
        records = list(records)
        if not self.settings.rolls_out(step):
            self.stats.gt_micro_steps += int(self.settings.stage2)
            prompts = encode_prompts(self.host, records)
            seed = self.settings.seed
            return [build_gt_sample(r, p, self.host, random.Random(f"coordexp-gt-prefix:{seed}:{step}:{r.source}"))
                    for r, p in zip(records, prompts, strict=True)]
        micro = self.next_micro_step(step)
        records = self.settings.expand(records)  # reward objective: each image's group of rollouts
        seeds = self.request_seeds(step, micro, len(records))
        key = (step, micro)
        start = time.perf_counter()
        got = self._take_rolled(key, records, seeds)
        self.sync_point(step)
        if got is None:
            got = self._roll_out_step(key, records, seeds, step)
        self._prefetch_after(key, step)
        generated = time.perf_counter()
        version = got.version
        outputs = [replace(o, policy_version=version) for o in got.outputs]
        if self.settings.reward_group:
            samples, groups = build_reward_samples(records, got.prompts, outputs, self.host, self.settings.reward_group,
                                                   version)
            self.stats.reward_groups.extend(groups)
        else:
            samples = _samples(records, got.prompts, outputs, self.host, version)
        self.stats.timed("rollout", generated - start)
        self.stats.seeds.extend(seeds)
        self._log_rollouts("train", step, micro, records, seeds, outputs, samples, got.metadata or {})
        self.stats.timed("host", time.perf_counter() - generated)
        return samples

    def _planned_share(self, plan: PlannedMicroStep) -> RolledOut:
        records = tuple(plan.records)
        return RolledOut(plan.key, records, tuple(self.request_seeds(*plan.key, len(records))),
                         tuple(encode_prompts(self.host, records)))

    def _take_rolled(self, key: tuple[int, int], records: list, seeds: list[int]) -> RolledOut | None:
        """``key``'s rollouts when a whole-step call or a prefetch already made them for these records and seeds
        (waiting for the prefetch), else None. Shares of earlier steps, and of a plan that diverged, are dropped."""
        for old in [k for k in self._rolled if k[0] < key[0]]:
            del self._rolled[old]
        share = self._rolled.pop(key, None)
        if share is not None:
            return share if share.is_for(key, records, seeds) else None
        if self.prefetcher is None or not self.prefetcher.in_flight:
            return None
        group, self._in_flight = self._in_flight, []
        requests_ok = bool(group) and group[0].is_for(key, records, seeds)
        got = self.prefetcher.take(group[0].key if requests_ok else key, [r for p in group for r in p.records],
                                   [s for p in group for s in p.seeds])
        if got is None or not requests_ok:
            return None
        self.stats.timed("rollout_generate", got.seconds)  # background generation time (overlapped)
        self.stats.add_drafts(got.metadata)
        first, *rest = _split(group, got.outputs, got.metadata, got.policy_version)
        self._rolled.update((part.key, part) for part in rest)
        return first

    def _roll_out_step(self, key: tuple[int, int], records: list, seeds: list[int], step: int) -> RolledOut:
        """``key``'s rollouts together with those of the step's later planned micro-steps, in ONE backend call
        after the step's sync point (the weights are the same for all of them)."""
        own = RolledOut(key, tuple(records), tuple(int(s) for s in seeds), tuple(encode_prompts(self.host, records)))
        ahead = {part.key for part in self._in_flight} | set(self._rolled)
        group = [own] + [self._planned_share(plan) for plan in self._planned
                         if plan.key[0] == step and plan.key > key and plan.key not in ahead]
        self._advise_call_size_once(sum(len(part.records) for part in group))
        outputs, metadata, _ = generate_with_metadata(self.backend, _group_requests(group, self.host,
                                                                                    self._greedy_every))
        self.stats.add_drafts(metadata)  # once per backend call (its parts share the call's metadata)
        first, *rest = _split(group, outputs, metadata, step)
        self._rolled.update((part.key, part) for part in rest)
        return first

    def _advise_call_size_once(self, prompts: int) -> None:
        """Said once: a step's prompts reach the engine in several calls because ``decode_batch_size`` (or, in
        server mode, this rank's chunk of it) is smaller than the step; an engine decodes a larger batch faster."""
        if self._calls_advised or self.settings.rank != 0:
            return
        self._calls_advised = True
        metadata = self.backend.run_metadata() if self.backend is not None else {}
        cap = int(metadata.get("per_rank_chunk") or self.settings.decode_batch_size)
        if prompts <= cap:
            return
        calls = -(-prompts // cap)
        logger.warning("one optimizer step rolls out %d prompts, which reach the rollout engine in %d calls of at most "
                       "%d (rollout_matching.decode_batch_size %d%s); a larger decode_batch_size (memory permitting) "
                       "sends the whole step at once. Said once.", prompts, calls, cap,
                       self.settings.decode_batch_size, ", spread over the servers' world size" if
                       "per_rank_chunk" in metadata else "")

    def _prefetch_after(self, key: tuple[int, int], step: int) -> None:
        """Request, with the weights the server holds now (overlap), the next planned micro-steps not rolled out
        yet: the rest of this step in one call, else the next step's first micro-step."""
        if self.prefetcher is None or self.prefetcher.in_flight:
            return
        pending = [plan for plan in self._planned if plan.key > key and plan.key not in self._rolled
                   and self.settings.rolls_out(plan.key[0])]
        if not pending:
            return
        group = [self._planned_share(plan) for plan in pending if plan.key[0] == pending[0].key[0]]
        self._in_flight = group
        self.prefetcher.request(group[0].key, _group_requests(group, self.host, self._greedy_every),
                                policy_version=step)

    def rows(self, samples: list[SampleTarget], step: int) -> list[list[SampleTarget]]:
        """Unpacked: one padded row of all samples. Packed: carried segments older than the staleness bound are
        dropped, the new ones added, and every row the step needs taken (:meth:`CarryBuffer.pop_rows`). The age of
        every trained sample is recorded here, when it trains."""
        if self.buffer is None:
            rows = [samples]
        else:
            bound = self.settings.staleness_bound
            dropped = self.buffer.drop_where(
                lambda s: s.policy_version is not None and step - s.policy_version > bound)
            self.stats.stale_dropped += len(dropped)
            self.buffer.add_many([(s, s.length) for s in samples])
            selections = self.buffer.pop_rows(keep_at_most=len(samples))
            self.stats.underfilled_rows += sum(row.fill_ratio < self.settings.min_fill_ratio for row in selections)
            self._advise_fill_once(selections, samples)
            rows = [list(row.items) for row in selections]
        self.stats.staleness.extend(step - s.policy_version for row in rows for s in row
                                    if s.policy_version is not None)
        return rows

    def _advise_fill_once(self, selections: Sequence[Any], samples: Sequence[Any]) -> None:
        """The run's first packed micro-step decides, once, whether its rows reach ``min_fill_ratio``, and if not
        says what would fill them, from this run's own sample lengths (``packing/fill_ratio`` is logged every
        step; the advice is not repeated)."""
        if self._fill_advised or not selections:
            return
        self._fill_advised = True
        s = self.settings
        length = self.buffer.packing_length if self.buffer is not None else (s.packing_length or 1)
        fill = sum(row.total_length for row in selections) / (len(selections) * length)
        lengths = [int(x.length) for x in samples]
        if fill >= s.min_fill_ratio or s.rank != 0 or not lengths:
            return
        mean, longest, total = sum(lengths) / len(lengths), max(lengths), sum(lengths)
        figures = (f"packed rows are filled {fill:.2f}, below training.packing_min_fill_ratio {s.min_fill_ratio:.2f}: "
                   f"a micro-step's {len(lengths)} samples hold {total} tokens ({mean:.0f} on average, the longest "
                   f"{longest}) for rows of {length}.")
        if total < s.min_fill_ratio * length:  # too few tokens per micro-step: every micro-step trains its own rows
            batch = max(len(lengths) + 1, math.ceil(s.min_fill_ratio * length / mean))
            row = max(longest, min(length, math.ceil(total / s.min_fill_ratio / 64) * 64))
            change = (f"To fill them raise training.per_device_train_batch_size to about {batch}, or shorten the rows "
                      f"(template.max_length) to about {row} (never below the longest sample: a longer one is "
                      "refused)")
        else:  # enough tokens, but segments this long leave gaps in rows this short
            row = math.ceil(2 * longest / 64) * 64
            change = (f"Segments this long leave gaps: lengthen the rows (template.max_length, else global_max_length) "
                      f"to about {max(row, length + 64)}")
        logger.warning("%s %s, or lower packing_min_fill_ratio to %.2f. Said once; packing/fill_ratio is logged "
                       "every step.", figures, change, fill)

    # -- evaluation --------------------------------------------------------------------------------------------
    def eval_chunks(self, records: Sequence["DetectionRecord"], step: int,
                    positions: Sequence[int] | None = None) -> Iterator[RolloutChunk]:
        """``records`` rolled out with the step's weights, chunk by chunk, seeds from the evaluation stream at each
        record's position in the evaluation set (``positions``; default ``0..n-1``). The sync point comes before
        the first chunk on every rank, so shards of different sizes issue no collective."""
        if self.backend is None:
            raise ValueError("rollout evaluation needs a rollout backend")
        records = list(records)
        positions = list(range(len(records))) if positions is None else [int(i) for i in positions]
        if len(positions) != len(records):
            raise ValueError(f"{len(records)} records but {len(positions)} evaluation indices")
        self.sync_point(step)
        seeds = [eval_rollout_seed(self.settings.seed, step, i) for i in positions]
        for chunk in iter_rollout_samples(self.backend, self.host, records, seeds,
                                          chunk=self.settings.decode_batch_size, policy_version=step,
                                          greedy=self.settings.greedy_eval):
            self._log_rollouts("eval", step, None, chunk.records, chunk.seeds, chunk.outputs, chunk.samples,
                               chunk.metadata)
            yield chunk

    def _log_rollouts(self, tag: str, step: int, micro: int | None, records, seeds, outputs, samples,
                      metadata: dict[str, Any]) -> None:
        self.run_log.write("rollout", tag=tag, global_step=int(step), micro_step=micro,
                           seeds=[int(s) for s in seeds], sources=[r.source for r in records],
                           response_tokens=[len(o.response_token_ids) for o in outputs],
                           policy_versions=[o.policy_version for o in outputs], backend=metadata)
        s = self.settings
        if s.rollout_log_every and s.rollout_log_dir is not None and step % s.rollout_log_every == 0:
            append_rollout_log(s.rollout_log_dir, [x.log_entry(r, step, tag, self.host.tokenizer)
                                                     for r, x in zip(records, samples)])

    def close(self, *, interrupted: bool = False) -> None:
        """Forget the in-flight prefetch (waited for unless the run was interrupted: a hung server must not hold
        Ctrl-C) before the backend is closed."""
        self._rolled.clear()
        self._in_flight = []
        if self.prefetcher is not None:
            self.prefetcher.close(wait=not interrupted)

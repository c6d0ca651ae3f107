"""Thin ``transformers.Trainer`` subclasses: the glue between the HF loop and the pure stage-2 modules.

Per micro-step (``compute_loss``): encode prompts -> rollouts (stage 2) or GT targets (stage 1) -> per-sample
``Y_train`` (:mod:`coordexp.runtime.train.rollout_step`) -> carry buffer + selection (packing) -> one forward per
packed row (LM head at the supervised positions only) -> :func:`coordexp.runtime.model.losses.compute_objective` with
the micro-step's denominators, so several rows add up to the unpacked loss and gradient. Rollout counters and loss
terms are summed over micro-steps (and ranks) and logged once per logging step. The carry buffer is rank-local, starts empty (also on resume), and
leftovers at the end of training are dropped (``packing_drop_last: true``, carry-only mode).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers import Trainer

from coordexp.runtime.core.distribution import eval_rollout_seed, train_request_seeds
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.model.losses import LossDenominators, SupervisionBatch, SupervisionSegment, compute_objective
from coordexp.runtime.model.packed_forward import (
    collate_packed,
    collate_padded,
    mrope_index_of,
    packed_forward,
    padded_forward,
)
from coordexp.runtime.core.packing import CarryBuffer
from coordexp.runtime.train.rollout_step import HostContext, SampleTarget, build_gt_sample, build_rollout_sample
from coordexp.runtime.core.telemetry import RolloutCounters, sum_counters
from coordexp.runtime.model.policy import save_processor
from coordexp.runtime.train.overlap import PlannedMicroStep, RolloutPrefetcher
from coordexp.runtime.train.run_log import RunLog, run_start_fields
from coordexp.runtime.train.visualize import append_rollout_log

if TYPE_CHECKING:
    from coordexp.runtime.rollout.base import RolloutBackend
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.schema.contract import RunContract

__all__ = ["CoordExpTrainer", "RecordDataset", "identity_collator", "StepStats"]

logger = logging.getLogger("coordexp.train")


class RecordDataset(torch.utils.data.Dataset):
    """Detection records as a map-style dataset; batches stay lists of records (see :func:`identity_collator`)."""

    def __init__(self, records: Sequence["DetectionRecord"]):
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> "DetectionRecord":
        return self.records[index]


def identity_collator(records: list["DetectionRecord"]) -> list["DetectionRecord"]:
    return records


class StepStats:
    """Sums over the micro-steps since the last log: loss terms (weighted by micro-step), tokens, counters."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.micro_steps = 0
        self.rows = 0  # forward rows (a packed micro-step may train several)
        self.underfilled_rows = 0  # packed rows filled below training.packing_min_fill_ratio
        self.terms: dict[str, float] = {}
        self.trained_tokens = 0
        self.computed_tokens = 0
        self.counters: list[RolloutCounters] = []
        self.seconds: dict[str, float] = {}
        self.seeds: list[int] = []  # this rank's training rollout seeds, in order
        self.staleness: list[int] = []  # per training sample: optimizer steps since the policy that generated it

    def timed(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def add(self, terms: dict[str, float], trained: int, computed: int, counters: list, rows: int = 1) -> None:
        self.micro_steps += 1
        self.rows += rows
        for key, value in terms.items():
            self.terms[key] = self.terms.get(key, 0.0) + float(value)
        self.trained_tokens += trained
        self.computed_tokens += computed
        self.counters.extend(c for c in counters if c is not None)


class CoordExpTrainer(Trainer):
    """Stage 1 (``stage1_sft``) or stage 2 (``stage2_rollout_aligned``); the variant comes from the contract."""

    # compute_loss returns a per-micro-step mean: the HF loop divides by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *args: Any,
        run: "RunContract",
        host: HostContext,
        backend: "RolloutBackend | None" = None,
        rollout_log_every: int = 0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("data_collator", identity_collator)
        super().__init__(*args, **kwargs)
        self.run = run
        self.host = host
        self.backend = backend
        self.stage2 = run.trainer_variant == "stage2_rollout_aligned"
        if self.stage2 and backend is None:
            raise ValueError("stage2_rollout_aligned needs a rollout backend (rollout_matching.rollout_backend)")
        packing = run.rollout_matching.packing
        self.buffer = CarryBuffer(packing.packing_length, packing.buffer) if packing.enabled else None
        self.rollout_log_every = int(rollout_log_every)
        self.stats = StepStats()
        # (global step, training micro-steps rolled out in it): seeds depend on the micro-step WITHIN the optimizer
        # step, so a run resumed at step k draws what the uninterrupted run drew (one tuple: callers save/restore it)
        self._micro_step: tuple[int, int] = (-1, 0)
        self.run_log = RunLog(self.args.output_dir, self.args.process_index)
        self._coord_ids = torch.tensor(host.vocab.ids, dtype=torch.long)
        overlap = run.rollout_matching.overlap
        # actor-learner overlap (server mode): the next micro-step's rollouts generate while this one trains
        self.prefetcher = RolloutPrefetcher(backend, overlap.staleness) if self.stage2 and overlap.enabled else None
        self._planned: list[PlannedMicroStep] = []  # micro-steps fetched from the dataloader, not yet rolled out
        self._lookahead: tuple[Any, Any] | None = None  # (epoch iterator, next step's first micro-batch)

    def train(self, *args: Any, **kwargs: Any):
        """The HF loop, after a ``run_start`` line in the run's metadata log (seed, decoding, backend, resume)."""
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        backend = self.backend
        self.run_log.write("run_start", **run_start_fields(
            self.run, world_size=self.args.world_size, backend_name=type(backend).__name__ if backend else None,
            backend_metadata=backend.run_metadata() if backend else {}, resume_from=resume))
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.prefetcher is not None:
                self.prefetcher.wait()  # the backend may be closed next: nothing may still be generating

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The HF fetch of one optimizer step's micro-batches; with overlap it also reads the NEXT step's first
        micro-batch (kept for the next call), so that micro-step's rollouts can be requested during this step."""
        if self.prefetcher is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = []
        if self._lookahead is not None and self._lookahead[0] is epoch_iterator:
            batches.append(self._lookahead[1])
        self._lookahead = None
        while len(batches) < num_batches:
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        step = int(self.state.global_step)
        self._planned = [PlannedMicroStep((step, i), tuple(b)) for i, b in enumerate(batches)]
        if batches:
            try:
                self._lookahead = (epoch_iterator, next(epoch_iterator))
                self._planned.append(PlannedMicroStep((step + 1, 0), tuple(self._lookahead[1])))
            except StopIteration:
                pass
        return batches, None

    def _requests(self, records: Sequence["DetectionRecord"], seeds: Sequence[int]):
        prompts = [encode_prompt(self.host.processor, r, self.host.template) for r in records]
        return prompts, [RolloutRequest(prompt=p, index=i, seed=int(seed), record=r)
                         for i, (r, p, seed) in enumerate(zip(records, prompts, seeds, strict=True))]

    def _generate(self, requests, records, seeds, tag: str, micro_step: int | None):
        """This micro-step's rollouts: pushed weights first, then generation (the on-policy default). With overlap
        (training only): take the prefetched rollouts, push the current weights (nothing is in flight now), then
        request the next planned micro-step's rollouts. Every output carries the policy version that made it."""
        step = int(self.state.global_step)
        model = self.accelerator.unwrap_model(self.model)
        got = None
        if self.prefetcher is not None:
            if tag == "train":
                got = self.prefetcher.take((step, micro_step), records, seeds)
            else:
                self.prefetcher.wait()  # never push weights under an in-flight request
        self.backend.sync_weights(model)
        if got is None:
            outputs, version = self.backend.generate(requests), step
        else:
            outputs, version = got.outputs, got.policy_version
            self.stats.timed("rollout_generate", got.seconds)  # background generation time (overlapped)
        if self.prefetcher is not None and tag == "train":
            following = [plan for plan in self._planned if plan.key > (step, micro_step)]
            if following:
                plan = following[0]
                next_seeds = self._request_seeds(*plan.key, len(plan.records))
                _, next_requests = self._requests(plan.records, next_seeds)
                self.prefetcher.request(plan.key, plan.records, next_requests, policy_version=step)
        if tag == "train":
            self.stats.staleness.extend([step - version] * len(outputs))
        return [replace(o, policy_version=version) for o in outputs]

    def create_optimizer(self, model=None):
        """HF's optimizer over per-part groups (lr / weight decay of llm, vision, aligner: docs/design.md,
        decision 13); a backend that offloads around rollouts (vLLM colocate) also gets a handle on it."""
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            from coordexp.runtime.train.optim import describe_groups, grouped_optimizer

            self.optimizer = grouped_optimizer(self, self.model if model is None else model, self.run.training)
            logger.info("optimizer groups: %s", "; ".join(describe_groups(self.optimizer.param_groups)))
        optimizer = super().create_optimizer(model)
        if self.backend is not None:
            self.backend.attach_optimizer(optimizer)
        return optimizer

    # -- one micro-step ---------------------------------------------------------------------------------------
    def build_samples(self, records: Sequence["DetectionRecord"]) -> list[SampleTarget]:
        """This micro-step's per-sample targets: rollouts through the backend (stage 2) or the GT serialization."""
        if self.stage2:
            micro, seeds = self.train_seeds(len(records))
            return self.rollout_samples(records, tag="train", seeds=seeds, micro_step=micro)
        prompts = [encode_prompt(self.host.processor, r, self.host.template) for r in records]
        return [build_gt_sample(r, p, self.host) for r, p in zip(records, prompts, strict=True)]

    def train_seeds(self, count: int) -> tuple[int, list[int]]:
        """The next training micro-step's index within the current optimizer step and its ``count`` seeds: a pure
        function of (seed, global step, micro-step in the step, rank, index) (:func:`train_request_seeds`)."""
        step = int(self.state.global_step)
        owner, drawn = self._micro_step
        micro = drawn if owner == step else 0
        self._micro_step = (step, micro + 1)
        return micro, self._request_seeds(step, micro, count)

    def _request_seeds(self, step: int, micro: int, count: int) -> list[int]:
        """This rank's ``count`` seeds for micro-step ``micro`` of optimizer step ``step``
        (:func:`train_request_seeds`), whether drawn now or for a prefetch."""
        stride = max(int(self.args.per_device_train_batch_size), count)
        return train_request_seeds(self.args.seed, step, micro, self.args.process_index,
                                   max(1, self.args.world_size), stride, count)

    def rollout_samples(self, records: Sequence["DetectionRecord"], *, tag: str, seeds: Sequence[int],
                        micro_step: int | None = None) -> list[SampleTarget]:
        """Roll ``records`` out through the backend (current weights) with one seed each and build each one's
        ``Y_train`` with its parse, match and counters; ``tag`` labels the rollout and metadata logs
        (``train`` / ``eval``)."""
        if self.backend is None:
            raise ValueError("rollouts need a rollout backend (rollout_matching.rollout_backend)")
        if len(seeds) != len(records):
            raise ValueError(f"{len(records)} records but {len(seeds)} seeds")
        prompts, requests = self._requests(records, seeds)
        self.backend.begin_step(self.state.global_step)
        start = time.perf_counter()
        outputs = self._generate(requests, records, seeds, tag, micro_step)
        generated = time.perf_counter()
        samples = [build_rollout_sample(r, p, o, self.host) for r, p, o in zip(records, prompts, outputs, strict=True)]
        self.stats.timed("rollout", generated - start)
        if tag == "train":
            self.stats.seeds.extend(int(s) for s in seeds)
        self.run_log.write("rollout", tag=tag, global_step=int(self.state.global_step), micro_step=micro_step,
                           seeds=[int(s) for s in seeds], sources=[r.source for r in records],
                           response_tokens=[len(o.response_token_ids) for o in outputs],
                           policy_versions=[o.policy_version for o in outputs],
                           backend=self.backend.run_metadata())
        self.stats.timed("host", time.perf_counter() - generated)
        if self.rollout_log_every and self.is_world_process_zero() and self.state.global_step % self.rollout_log_every == 0:
            append_rollout_log(
                self.args.output_dir, [s.log_entry(r, self.state.global_step, tag) for r, s in zip(records, samples)]
            )
        return samples

    def _rows(self, samples: list[SampleTarget]) -> list[list[SampleTarget]]:
        """Unpacked: one padded forward of all samples. Packed: add them to the carry buffer and take every row the
        step needs (:meth:`CarryBuffer.pop_rows`), so the carry never holds more than this step's segments."""
        if self.buffer is None:
            return [samples]
        self.buffer.add_many([(s, s.length) for s in samples])
        rows = self.buffer.pop_rows(keep_at_most=len(samples))
        floor = self.run.rollout_matching.packing.min_fill_ratio
        self.stats.underfilled_rows += sum(row.fill_ratio < floor for row in rows)
        return [list(row.items) for row in rows]

    def _layout(self, selected: list[SampleTarget], rope: Any) -> tuple[Any, torch.Tensor, SupervisionBatch]:
        """One forward row-set's collated inputs, kept logit positions and supervision."""
        encoded = [s.encoded for s in selected]
        collate = collate_packed if self.buffer is not None else collate_padded
        batch = collate(encoded, rope, pad_token_id=self._pad_id())
        segments = [
            SupervisionSegment(s.supervision, s.target.ids, *batch.placement(i)) for i, s in enumerate(selected)
        ]
        # The losses read assistant-span logits only: the LM head runs at those positions (logits_to_keep).
        keep, supervision = SupervisionBatch.from_segments(segments, batch.seq_len).at_kept_positions()
        return batch, keep, supervision

    def _objective(self, model, unwrapped, layout, denominators: LossDenominators):
        batch, keep, supervision = layout
        if self.buffer is not None:
            # Inputs are built from the unwrapped model (its config); the call goes through the wrapper (DDP hooks).
            logits = packed_forward(model, batch, logits_to_keep=keep, inputs_from=unwrapped)
        else:
            logits = padded_forward(model, batch, logits_to_keep=keep)
        coord_ids = self._coord_ids.to(logits.device)
        pipeline = self.run.rollout_matching.pipeline
        return logits, compute_objective(logits, supervision.to(logits.device), coord_ids, pipeline, denominators)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-step's loss. Every row but the last runs its own forward and backward here (gradient sync
        off, same accumulation scaling as the HF step); the last row's loss goes back to the HF loop, which
        backpropagates it with the sync every rank does exactly once. Each row divides by the whole micro-step's
        denominators, so the summed gradient equals the unpacked batch's."""
        records = list(inputs)
        samples = self.build_samples(records)
        started = time.perf_counter()
        unwrapped = self.accelerator.unwrap_model(model)
        rope = mrope_index_of(unwrapped)
        layouts = [self._layout(row, rope) for row in self._rows(samples)]
        denominators = sum((LossDenominators.of(layout[2]) for layout in layouts[1:]), LossDenominators.of(layouts[0][2]))
        terms: dict[str, float] = {}
        earlier = 0.0  # the rows already backpropagated: their loss joins the reported value, not the graph
        row_backward = 0.0
        for index, layout in enumerate(layouts):
            last = index == len(layouts) - 1
            if last:
                logits, result = self._objective(model, unwrapped, layout, denominators)
            else:
                with self.accelerator.no_sync(model):
                    logits, result = self._objective(model, unwrapped, layout, denominators)
                    backward_start = time.perf_counter()
                    self.accelerator.backward(result.total / self.current_gradient_accumulation_steps)
                    row_backward += time.perf_counter() - backward_start  # training_step books it as backward
                earlier += float(result.total.detach())
                del logits
            for key, value in result.terms.items():
                terms[key] = terms.get(key, 0.0) + value
        self.stats.timed("forward", time.perf_counter() - started - row_backward)
        self.stats.add(
            terms,
            trained=sum(layout[0].num_real_tokens for layout in layouts),
            computed=sum(layout[0].num_token_slots for layout in layouts),
            counters=[s.counters for s in samples],
            rows=len(layouts),
        )
        total = result.total + earlier if earlier else result.total
        return (total, logits) if return_outputs else total

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The HF step, timed: ``time/backward`` is the step minus the rollout, host and forward time inside it."""
        before = dict(self.stats.seconds)
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        inside = sum(self.stats.seconds.get(k, 0.0) - before.get(k, 0.0) for k in ("rollout", "host", "forward"))
        self.stats.timed("backward", time.perf_counter() - start - inside)
        return loss

    def _pad_id(self) -> int:
        tokenizer = self.host.tokenizer
        return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.host.eos_id)

    # -- logging ----------------------------------------------------------------------------------------------
    def _reduced(self, values: list[float], op: str = "sum") -> list[float]:
        """``values`` reduced over ranks (``sum``, ``min`` or ``max``); every rank must call it (a collective)."""
        if self.args.world_size <= 1 or not torch.distributed.is_initialized():
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.args.device)
        reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "min": torch.distributed.ReduceOp.MIN,
                     "max": torch.distributed.ReduceOp.MAX}[op]
        torch.distributed.all_reduce(tensor, op=reduce_op)
        return tensor.tolist()

    def step_log_values(self) -> dict[str, float]:
        """Loss terms (mean over micro-steps and ranks), counters (summed, ratios from sums), packing, tokens."""
        stats = self.stats
        keys = sorted(stats.terms)
        # Every rank runs the same modules, so every rank has the same term keys in the same order.
        buffered = len(self.buffer) if self.buffer is not None else 0
        sums = self._reduced(
            [stats.terms[k] for k in keys]
            + [stats.micro_steps, stats.trained_tokens, buffered, stats.computed_tokens, stats.rows, stats.underfilled_rows]
        )
        micro = max(sums[len(keys)], 1.0)
        logs = {f"loss/{k}": v / micro for k, v in zip(keys, sums[: len(keys)])}
        logs["tokens/trained"] = sums[len(keys) + 1]
        # positions the forwards computed (padding included): the padded layout's waste is 1 - trained / computed
        logs["tokens/computed"] = sums[len(keys) + 3]
        logs.update({f"time/{k}_s": v for k, v in sorted(stats.seconds.items())})  # this rank's wall time per stage
        compute = stats.seconds.get("forward", 0.0) + stats.seconds.get("backward", 0.0)
        if compute > 0:
            logs["tokens/trained_per_s"] = stats.trained_tokens / compute  # this rank, forward + backward only
        if self.buffer is not None and stats.micro_steps:
            packing = self.run.rollout_matching.packing
            rows, underfilled = max(sums[len(keys) + 4], 1.0), sums[len(keys) + 5]
            # trained tokens over the row capacity of every packed forward row (all ranks)
            logs["packing/fill_ratio"] = sums[len(keys) + 1] / (rows * self.buffer.packing_length)
            logs["packing/buffered"] = sums[len(keys) + 2]  # carried segments, all ranks
            logs["packing/rows"] = rows  # forward rows, all ranks (several per micro-step when a step overflows one)
            logs["packing/underfilled_rows"] = underfilled
            if underfilled and self.is_world_process_zero():
                logger.warning(
                    "%d of %d packed rows were filled below training.packing_min_fill_ratio=%.2f (mean fill %.2f): "
                    "rows run emptier than configured; raise the per-device batch size or lower global_max_length.",
                    underfilled, rows, packing.min_fill_ratio, logs["packing/fill_ratio"],
                )
        if self.prefetcher is not None:
            # optimizer steps between the generating policy and the trained one (all ranks; <= overlap.staleness)
            (worst,) = self._reduced([float(max(stats.staleness, default=0))], "max")
            total, count = self._reduced([float(sum(stats.staleness)), float(len(stats.staleness))])
            if count:
                logs["rollout/staleness_max"], logs["rollout/staleness_mean"] = worst, total / count
        if self.stage2:
            counters = sum_counters(stats.counters) if stats.counters else RolloutCounters()
            if self.args.world_size > 1 and torch.distributed.is_initialized():
                tensor = counters.to_tensor().to(self.args.device)
                torch.distributed.all_reduce(tensor)
                counters = RolloutCounters.from_tensor(tensor.cpu())
            logs.update(counters.to_log_dict(prefix="rollout/"))
            # the lowest and highest rollout seed of the window over all ranks (every seed is in the run log)
            (first,) = self._reduced([float(min(stats.seeds, default=float("inf")))], "min")
            (last,) = self._reduced([float(max(stats.seeds, default=float("-inf")))], "max")
            if first != float("inf"):
                logs["rollout/seed_first"], logs["rollout/seed_last"] = first, last
            fallbacks = self.backend.run_metadata().get("fallback_events") if self.backend is not None else None
            if fallbacks is not None:
                logs["rollout/sync_fallbacks"] = float(len(fallbacks))
        return logs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.stats.micro_steps:
            logs.update(self.step_log_values())
            self.stats.reset()
        super().log(logs, start_time)

    # -- evaluation -------------------------------------------------------------------------------------------
    def eval_samples(self, records: Sequence["DetectionRecord"], indices: Sequence[int] | None = None
                     ) -> list[SampleTarget]:
        """Every record rolled out (chunks of ``decode_batch_size``) and parsed/matched like a training sample, in
        record order: the per-sample evidence (``parse``, ``match``, ``counters``) evaluation metrics read. Seeds
        come from the evaluation stream (:func:`eval_rollout_seed`) at each record's position in the evaluation set
        (``indices``; default ``0..n-1``), never from the training micro-steps."""
        if self.backend is None:
            raise ValueError("rollout evaluation needs a rollout backend")
        positions = list(range(len(records))) if indices is None else [int(i) for i in indices]
        if len(positions) != len(records):
            raise ValueError(f"{len(records)} records but {len(positions)} evaluation indices")
        seeds = [eval_rollout_seed(self.args.seed, self.state.global_step, i) for i in positions]
        chunk = self.run.rollout_matching.decode_batch_size
        samples: list[SampleTarget] = []
        for start in range(0, len(records), chunk):
            samples += self.rollout_samples(records[start : start + chunk], tag="eval",
                                            seeds=seeds[start : start + chunk])
        return samples

    def evaluate_rollouts(self, records: Sequence["DetectionRecord"]) -> RolloutCounters:
        """The rollout counters of :meth:`eval_samples`, summed; no training."""
        counters = [s.counters for s in self.eval_samples(records) if s.counters is not None]
        return sum_counters(counters) if counters else RolloutCounters()

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            return {}
        records = list(getattr(dataset, "records", dataset))
        world = max(1, self.args.world_size)
        shard = records[self.args.process_index :: world]
        positions = range(self.args.process_index, len(records), world)  # seeds follow the record, not the shard
        from coordexp.runtime.train.evaluate import detection_metrics, score_samples

        # COCO AP (objects ranked by their tokens' log-probability) next to the counters, as `coordexp eval` reports
        scored = score_samples(self.accelerator.unwrap_model(self.model), self.host, shard, self.eval_samples(shard, positions),
                               step=self.state.global_step, batch_size=self.run.rollout_matching.decode_batch_size)
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * self.args.world_size
            torch.distributed.all_gather_object(gathered, scored)  # AP needs every rank's predictions
            scored = [rollout for part in gathered for rollout in part]
        metrics = detection_metrics(scored, image_root=self.run.data.image_root)[0].log_dict(metric_key_prefix)
        super().log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resume with the checkpoint's weights under the model's own names (:mod:`.checkpoint_load`: HF's loader
        matched none of a Qwen-VL checkpoint's legacy names and resumed from the base weights); other layouts
        (adapters, sharded FSDP) go to HF's loader."""
        from coordexp.runtime.train.checkpoint_load import load_checkpoint_weights

        if not load_checkpoint_weights(model if model is not None else self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Checkpoints carry the processor too, so a checkpoint loads like any Qwen-VL checkpoint."""
        super()._save(output_dir, state_dict)
        out = Path(output_dir or self.args.output_dir)
        processor = self.host.processor
        if hasattr(processor, "save_pretrained"):
            processor.save_pretrained(str(out))
        else:
            family = self.accelerator.unwrap_model(self.model).config.model_type
            save_processor(out, family, processor.tokenizer, processor.image_processor)

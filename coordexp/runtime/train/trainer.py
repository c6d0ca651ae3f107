"""Thin ``transformers.Trainer`` subclass: forward/backward over the rows the micro-step pipeline hands it, logging,
evaluation and checkpoint glue.

Per micro-step (``compute_loss``): :class:`coordexp.runtime.train.pipeline.MicroStepPipeline` turns the records into
forward rows (rollouts or GT targets, the step's one weight-sync point, carry buffer, staleness), then one forward per
row (LM head at the supervised positions only) and :func:`coordexp.runtime.model.losses.compute_objective` with the
micro-step's denominators, so several rows add up to the unpacked loss and gradient. Rollout counters and loss terms
are summed over micro-steps (and ranks) and logged once per logging step (:mod:`.metrics`). The carry buffer is
rank-local, starts empty (also on resume), and leftovers at the end of training are dropped.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import torch
from transformers import Trainer, TrainerCallback
from transformers.integrations import TensorBoardCallback

from coordexp.runtime.train.divergence import diverged
from coordexp.runtime.model.data import with_object_permutation
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.model.losses import LossDenominators, SupervisionBatch, SupervisionSegment, compute_objective
from coordexp.runtime.model.packed_forward import (
    collate_packed,
    collate_padded,
    mrope_index_of,
    packed_forward,
    padded_forward,
)
from coordexp.runtime.model.policy import LaunchError, save_processor
from coordexp.runtime.model.policy_gradient import frozen_reference, reference_log_probs, reward_objective
from coordexp.runtime.model.token_types import TokenTypeSums, TokenTypeWindow, token_type_totals
from coordexp.runtime.model.weight_version import note_optimizer_step
from coordexp.runtime.rollout.weight_export import full_parameters, zero3_partitioned
from coordexp.runtime.rollout.zero3_decode import GatheredDecodeModel
from coordexp.runtime.train import checkpoints
from coordexp.runtime.train.collapse import CollapseCallback
from coordexp.runtime.train.dataset import identity_collator
from coordexp.runtime.train.deepspeed import backward_row, padding_rows
from coordexp.runtime.train.metrics import StepStats, WindowContext, reduce_values, step_log_values
from coordexp.runtime.train.pipeline import MicroStepPipeline, PipelineSettings
from coordexp.runtime.train.progress import report_eval_progress
from coordexp.runtime.train.rollout_step import HostContext, SampleTarget, build_gt_sample
from coordexp.runtime.train.run_log import RunLog, run_start_fields

if TYPE_CHECKING:
    from coordexp.runtime.rollout.base import RolloutBackend
    from coordexp.schema.contract import RunContract

__all__ = ["CoordExpTrainer"]

logger = logging.getLogger("coordexp.train")

# accelerate distributed types whose backward can step the optimizer or shard parameters: several backward calls
# in one micro-step (multi-row packing) would take several optimizer steps there (docs/design.md, decision 14).
# DeepSpeed is not one of them: its row backwards are told they are no accumulation boundary (deepspeed.backward_row).
_ONE_BACKWARD_ONLY = ("FSDP", "MEGATRON_LM", "XLA")


class RowLayout(NamedTuple):
    """One forward row as collated: inputs, the logit positions the LM head keeps, their supervision."""

    batch: Any
    keep: torch.Tensor
    supervision: SupervisionBatch
    packed: bool


class WeightStepRecorder(TrainerCallback):
    """After every optimizer step (plain, fused or foreach, DeepSpeed's engine step included: HF calls this right
    after it), tell :mod:`coordexp.runtime.model.weight_version` that the weights changed, so the next rollout,
    evaluation or push never reads a copy made before the step."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            note_optimizer_step(model)


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
        self.add_callback(WeightStepRecorder())
        _file_eval_figures_under_eval(self)
        self.run = run
        self.host = host
        self.stage2 = run.trainer_variant == "stage2_rollout_aligned"
        distributed = str(getattr(self.accelerator.distributed_type, "name", self.accelerator.distributed_type))
        if run.rollout_matching.packing.enabled and distributed in _ONE_BACKWARD_ONLY:
            raise LaunchError(
                f"training.packing: true under accelerate's {distributed} is refused: a micro-step whose segments "
                "need several packed rows backpropagates once per row, which FSDP turns into extra optimizer "
                "steps", hint="Set training.packing: false, or train with DDP or DeepSpeed (training.deepspeed).")
        self.stats = StepStats()
        self.padding_rows_run = 0  # DeepSpeed: gradient-free rows this rank ran so ranks' collectives pair up
        self._scoring_copy = GatheredDecodeModel()  # ZeRO-3: evaluation scores rollouts on whole weights
        self.run_log = RunLog(self.args.output_dir, self.args.process_index)
        settings = PipelineSettings.of(run, self.args, rollout_log_every=rollout_log_every)
        self.pipeline = MicroStepPipeline(host, backend, settings, stats=self.stats, run_log=self.run_log,
                                          policy=lambda: self.accelerator.unwrap_model(self.model))
        self._coord_ids = torch.tensor(host.vocab.ids, dtype=torch.long)
        self._lookahead: tuple[Any, Any] | None = None  # (epoch iterator, next step's first micro-batch)
        self._record_index: dict[str, int] | None = None  # training record source -> index (object_order: random)
        reward = run.rollout_matching.reward
        # the reward objective's KL term reads a frozen copy of the starting checkpoint (docs/design.md, decision 19)
        self._reference = (frozen_reference(self.model) if self.stage2 and run.rollout_matching.objective == "reward"
                           and reward.kl_weight > 0 else None)
        if self.stage2 and run.rollout_matching.collapse_alarm.enabled:
            self.add_callback(CollapseCallback(run.rollout_matching.collapse_alarm, say=_warn_line,
                                               record=self.run_log.write))

    @property
    def backend(self) -> "RolloutBackend | None":
        return self.pipeline.backend

    @backend.setter
    def backend(self, backend: "RolloutBackend | None") -> None:
        self.pipeline.backend = backend

    @property
    def buffer(self):
        return self.pipeline.buffer

    @buffer.setter
    def buffer(self, buffer) -> None:
        self.pipeline.buffer = buffer

    @property
    def prefetcher(self):
        return self.pipeline.prefetcher

    def train(self, *args: Any, **kwargs: Any):
        """The HF loop, after a ``run_start`` line in the run's metadata log (seed, decoding, backend, resume)."""
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        backend = self.backend
        self.run_log.write("run_start", **run_start_fields(
            self.run, world_size=self.args.world_size, backend_name=type(backend).__name__ if backend else None,
            backend_metadata=backend.run_metadata() if backend else {}, resume_from=resume))
        if self.args.should_save:
            for path in checkpoints.clear_staging(self.args.output_dir):
                logger.warning("removed %s: a checkpoint save that never completed", path)
        interrupted = False
        try:
            return super().train(*args, **kwargs)
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            # the backend may be closed next: nothing may still be generating (unless Ctrl-C: never wait on a hung server)
            self.pipeline.close(interrupted=interrupted)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The HF fetch of one optimizer step's micro-batches; with overlap it also reads the NEXT step's first
        micro-batch (kept for the next call, never past ``max_steps``), so that micro-step's rollouts can be
        requested during this step. Records leave here in ``data.object_order`` (:meth:`_object_order`). The
        pipeline gets the step's plan either way: stage 2 rolls the whole step out in one backend call."""
        if self.pipeline.prefetcher is None:
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            batches = [self._object_order(batch) for batch in batches]
            self.pipeline.plan(int(self.state.global_step), batches, None)
            return batches, items
        batches = []
        if self._lookahead is not None and self._lookahead[0] is epoch_iterator:
            batches.append(self._lookahead[1])
        self._lookahead = None
        while len(batches) < num_batches:
            try:
                batches.append(self._object_order(next(epoch_iterator)))
            except StopIteration:
                break
        step = int(self.state.global_step)
        following = None
        if batches and self.pipeline.wants_lookahead(step):
            try:
                self._lookahead = (epoch_iterator, self._object_order(next(epoch_iterator)))
                following = self._lookahead[1]
            except StopIteration:
                pass
        self.pipeline.plan(step, batches, following)
        return batches, None

    def _object_order(self, records: Sequence[Any]) -> list[Any]:
        """``data.object_order: random``: each training record's objects in the order drawn from (training.seed,
        epoch, the record's index in the training set), so a resumed run (same epoch, same records) trains the
        same serializations; other orders leave the records as loaded."""
        records = list(records)
        if self.run.data.object_order != "random":
            return records
        if self._record_index is None:  # records cross dataloader workers by value: their file:line names them
            self._record_index = {}
            for i, record in enumerate(getattr(self.train_dataset, "records", ())):
                self._record_index.setdefault(record.source, i)
        # HF's state.epoch is epoch + (steps done) / (steps per epoch): its floor is the epoch being read
        epoch = math.floor(self.state.epoch or 0)
        return [with_object_permutation(r, seed=int(self.args.seed), epoch=epoch,
                                        index=self._record_index.get(r.source, 0)) for r in records]

    def create_optimizer(self, model=None):
        """HF's optimizer over per-part groups (lr / weight decay of llm, vision, aligner: docs/design.md,
        decision 13); a backend that offloads around rollouts (vLLM colocate) also gets a handle on it."""
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            from coordexp.runtime.train.optim import describe_groups, grouped_optimizer

            self.optimizer = grouped_optimizer(self, self.model if model is None else model, self.run.training,
                                              self.run.tuner)
            logger.info("optimizer groups: %s", "; ".join(describe_groups(self.optimizer.param_groups)))
        optimizer = super().create_optimizer(model)
        if self.backend is not None:
            self.backend.attach_optimizer(optimizer)
        return optimizer

    # -- one micro-step ---------------------------------------------------------------------------------------
    def _layout(self, selected: list[SampleTarget], rope: Any, *, packed: bool) -> RowLayout:
        """One forward row's collated inputs, kept logit positions and supervision (one packed row, or padded)."""
        encoded = [s.encoded for s in selected]
        collate = collate_packed if packed else collate_padded
        batch = collate(encoded, rope, pad_token_id=self._pad_id())
        segments = [
            SupervisionSegment(s.supervision, s.target.ids, *batch.placement(i)) for i, s in enumerate(selected)
        ]
        # The losses read assistant-span logits only: the LM head runs at those positions (logits_to_keep).
        keep, supervision = SupervisionBatch.from_segments(segments, batch.seq_len).at_kept_positions()
        return RowLayout(batch, keep, supervision, packed)

    def _objective(self, model, unwrapped, layout: RowLayout, denominators: LossDenominators):
        batch, keep, supervision, packed = layout
        if packed:
            # Inputs are built from the unwrapped model (its config); the call goes through the wrapper (DDP hooks).
            logits = packed_forward(model, batch, logits_to_keep=keep, inputs_from=unwrapped)
        else:
            logits = padded_forward(model, batch, logits_to_keep=keep)
        coord_ids = self._coord_ids.to(logits.device)
        pipeline = self.run.rollout_matching.pipeline
        supervision = supervision.to(logits.device)
        if self.run.training.token_type_metrics and torch.is_grad_enabled():  # the rows a training step trains
            self.stats.token_types += token_type_totals(logits.detach(), supervision, coord_ids)  # stays on device
        rm = self.run.rollout_matching
        repeat_ul = rm.repeat_unlikelihood if rm.repeats == "unlikelihood" else None
        if self.stage2 and rm.objective == "reward":
            reference = None
            if self._reference is not None and supervision.pg_logit_index.numel():
                with torch.no_grad():
                    ref = self._reference_on(logits.device)
                    ref_logits = (packed_forward(ref, batch, logits_to_keep=keep, inputs_from=ref) if packed
                                  else padded_forward(ref, batch, logits_to_keep=keep))
                    reference = reference_log_probs(ref_logits, supervision, coord_ids)
                    del ref_logits
            return logits, reward_objective(logits, supervision, coord_ids, pipeline, denominators,
                                            rm.reward.sft_weight, repeat_ul, reference_log_p=reference,
                                            kl_weight=rm.reward.kl_weight)
        return logits, compute_objective(logits, supervision, coord_ids, pipeline, denominators, repeat_ul)

    def _reference_on(self, device: torch.device) -> Any:
        """The frozen reference on the policy's device: under DeepSpeed the engine places the policy when training
        starts, after the copy was taken from the model as loaded."""
        if next(self._reference.parameters()).device != device:
            self._reference = self._reference.to(device)
        return self._reference

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The micro-step's loss. Every row but the last runs its own forward and backward here (gradient sync
        off, same accumulation scaling as the HF step); the last row's loss goes back to the HF loop, which
        backpropagates it with the sync every rank does exactly once. Each row divides by the whole micro-step's
        denominators, so the summed gradient equals the unpacked batch's. Under DeepSpeed a rank with fewer rows
        than another adds gradient-free rows first (:meth:`_padding_row`)."""
        step = int(self.state.global_step)
        samples = self.pipeline.samples(list(inputs), step)
        started = time.perf_counter()
        unwrapped = self.accelerator.unwrap_model(model)
        rope = mrope_index_of(unwrapped)
        packed = self.buffer is not None
        layouts = [self._layout(row, rope, packed=packed) for row in self.pipeline.rows(samples, step)]
        denominators = self._denominators_of_all_ranks(model, sum(
            (LossDenominators.of(layout.supervision) for layout in layouts[1:]),
            LossDenominators.of(layouts[0].supervision)))
        terms: dict[str, float] = {}
        earlier = 0.0  # the rows already backpropagated: their loss joins the reported value, not the graph
        row_backward = 0.0
        padding = padding_rows(self.accelerator, len(layouts))
        for index, layout in enumerate(layouts):
            last = index == len(layouts) - 1
            if last:
                for _ in range(padding):
                    row_backward += self._padding_row(model, unwrapped, layouts)
                self.padding_rows_run += padding
                logits, result = self._objective(model, unwrapped, layout, denominators)
                self._require_finite_loss(result.total, step)
            else:
                with self.accelerator.no_sync(model):
                    logits, result = self._objective(model, unwrapped, layout, denominators)
                    self._require_finite_loss(result.total, step)
                    backward_start = time.perf_counter()
                    backward_row(self.accelerator, result.total / self.current_gradient_accumulation_steps)
                    row_backward += time.perf_counter() - backward_start  # training_step books it as backward
                earlier += float(result.total.detach())
                del logits
            for key, value in result.terms.items():
                terms[key] = terms.get(key, 0.0) + value
            if self.stage2 and self.run.rollout_matching.objective == "reward":
                self.stats.add_entropy(result.diagnostics)
        self.stats.timed("forward", time.perf_counter() - started - row_backward)
        self.stats.add(
            terms,
            trained=sum(layout.batch.num_real_tokens for layout in layouts),
            computed=sum(layout.batch.num_token_slots for layout in layouts),
            counters=[s.counters for s in samples],
            rows=len(layouts),
        )
        total = result.total + earlier if earlier else result.total
        return (total, logits) if return_outputs else total

    def _denominators_of_all_ranks(self, model, denominators: LossDenominators) -> LossDenominators:
        """The training micro-step's counts summed over ranks under DDP or ZeRO (a collective every rank's
        micro-step calls), so every term is the token mean over all ranks' positions, as in one process at the
        global batch: a per-rank mean would weigh a rank's short targets (few objects, early stops) as much as
        another's long ones (docs/design.md, decision 19; issue 52 for the policy gradient)."""
        world = int(self.args.world_size)
        if world <= 1 or not model.training or not torch.distributed.is_initialized():
            return denominators
        return denominators.over_ranks(
            lambda counts: reduce_values(counts, "sum", world_size=world, device=self.args.device), world)

    def _require_finite_loss(self, loss: torch.Tensor, step: int) -> None:
        """A NaN or Inf loss stops the run before its backward: logged values alone miss it (transformers'
        ``logging_nan_inf_filter`` drops them), and one step later a checkpoint of non-finite weights is written."""
        if not bool(torch.isfinite(loss.detach()).all()):
            raise diverged("the loss", float(loss.detach()), step + 1, self.args.output_dir, ", before its backward")

    def _padding_row(self, model, unwrapped, layouts: Sequence[RowLayout]) -> float:
        """A forward and backward of this rank's shortest row with loss ``0 * sum(logits)``: the gradient is
        unchanged, but the same parameters gather and reduce as in a real row, so ranks' ZeRO collectives pair up
        (:func:`padding_rows`). Returns the seconds it took (booked as backward)."""
        started = time.perf_counter()
        batch, keep, _, packed = min(layouts, key=lambda layout: layout.batch.num_token_slots)
        with self.accelerator.no_sync(model):
            if packed:
                logits = packed_forward(model, batch, logits_to_keep=keep, inputs_from=unwrapped)
            else:
                logits = padded_forward(model, batch, logits_to_keep=keep)
            backward_row(self.accelerator, logits.sum() * 0.0)
        return time.perf_counter() - started

    @torch.no_grad()
    def validation_loss(self, samples: Sequence[SampleTarget]) -> float:
        """The objective of ``samples`` in one padded forward, no gradient (the carry buffer and stats untouched)."""
        model = self.model
        unwrapped = self.accelerator.unwrap_model(model)
        layout = self._layout(list(samples), mrope_index_of(unwrapped), packed=False)
        _, result = self._objective(model, unwrapped, layout, LossDenominators.of(layout.supervision))
        return float(result.total)

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
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "train_runtime" in logs and self.stats.micro_steps:  # the last, partial window: logged, not dropped
            self.log({"window": "final"}, start_time)
        if ("loss" in logs or logs.get("window") == "final") and self.stats.micro_steps:
            backend = self.backend
            fallbacks = backend.run_metadata().get("fallback_events") if backend is not None else None
            packing = self.run.rollout_matching.packing
            logs.update(step_log_values(self.stats, WindowContext(
                world_size=int(self.args.world_size), device=self.args.device, stage2=self.stage2,
                buffered=len(self.buffer) if self.buffer is not None else None,
                packing_length=self.buffer.packing_length if self.buffer is not None else packing.packing_length,
                min_fill_ratio=packing.min_fill_ratio,
                fallback_events=None if fallbacks is None else len(fallbacks),
                is_main=self.is_world_process_zero(), token_type_metrics=self.run.training.token_type_metrics,
                reward=self.stage2 and self.run.rollout_matching.objective == "reward")))
            self.stats.reset()
        super().log(logs, start_time)

    # -- evaluation -------------------------------------------------------------------------------------------
    def scored_chunks(self, records: Sequence[Any], positions: Sequence[int] | None = None):
        """``(chunk, scored rollouts)`` per evaluation chunk of ``records`` at the current step
        (:meth:`MicroStepPipeline.eval_chunks`): each valid object with its tokens' log-probability, the ranking COCO
        AP uses, as `coordexp eval` reports."""
        from coordexp.runtime.train.evaluate import score_samples

        step = int(self.state.global_step)
        model = self.accelerator.unwrap_model(self.model)
        if zero3_partitioned(model):  # scoring forwards differ per rank: a whole copy, gathered while ranks agree
            with full_parameters(model):
                model = self._scoring_copy.model_for(model)
        for chunk in self.pipeline.eval_chunks(records, step, positions):
            yield chunk, score_samples(model, self.host, chunk.records, chunk.samples, step=step,
                                       batch_size=self.run.rollout_matching.decode_batch_size)

    @torch.no_grad()
    def teacher_forced_sums(self, records: Sequence[Any], positions: Sequence[int] | None = None) -> TokenTypeSums:
        """Token figures of ``records[positions]`` teacher-forced on their ground-truth serialization (the stage-1
        target, :func:`build_gt_sample`): one padded forward without gradients per ``per_device_eval_batch_size``
        records, logits only at the supervised positions. Every rank runs as many forwards as the largest shard
        of ``records`` needs (a short rank repeats ``records[0]`` and drops its figures), so forwards that gather
        parameters (ZeRO-3) pair up; ``positions=None`` is all records on this rank alone."""
        world = max(1, int(self.args.world_size)) if positions is not None else 1
        mine = [records[i] for i in (range(len(records)) if positions is None else positions)]
        size = max(1, int(self.args.per_device_eval_batch_size))
        forwards = max(math.ceil(len(mine) / size), math.ceil(math.ceil(len(records) / world) / size))
        model = self.accelerator.unwrap_model(self.model)
        rope = mrope_index_of(model)
        total = TokenTypeWindow()  # summed on the device, read once at the end
        was_training = model.training
        model.eval()
        try:
            for k in range(forwards):
                part = mine[k * size:(k + 1) * size]
                counted = bool(part)
                part = part or [records[0]]
                samples = [build_gt_sample(r, encode_prompt(self.host.processor, r, self.host.template), self.host)
                           for r in part]
                layout = self._layout(samples, rope, packed=False)
                logits = padded_forward(model, layout.batch, logits_to_keep=layout.keep)
                if counted:
                    total += token_type_totals(logits, layout.supervision.to(logits.device),
                                               self._coord_ids.to(logits.device))
                del logits
        finally:
            model.train(was_training)
        return TokenTypeSums.from_list(total.to_list())

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Rollout evaluation: each rank rolls out its shard (every ``world``-th record), scores it, and rank-ordered
        results are gathered for COCO AP. The shard sizes may differ: no collective runs per chunk. Next to AP, the
        teacher-forced token figures of the same shards (:meth:`teacher_forced_sums`, summed over ranks)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            return {}
        from coordexp.runtime.train.evaluate import detection_metrics

        records = list(getattr(dataset, "records", dataset))
        world, rank = max(1, int(self.args.world_size)), int(self.args.process_index)
        positions = list(range(rank, len(records), world))  # seeds follow the record, not the shard
        step = int(self.state.global_step)
        rollouts: list[Any] = []
        report_eval_progress(self, 0, len(positions))  # the progress line and the run's ETA time the evaluation
        try:
            for _, scored in self.scored_chunks([records[i] for i in positions], positions):
                rollouts.extend(scored)
                report_eval_progress(self, len(rollouts), len(positions))
        finally:
            self._scoring_copy.release()  # ZeRO-3: the whole copy lives for one evaluation, not the rest of the run
        scored = list(zip(positions, rollouts, strict=True))
        if world > 1 and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * world
            torch.distributed.all_gather_object(gathered, scored)  # AP needs every rank's predictions
            scored = [item for part in gathered for item in part]
        ordered = [rollout for _, rollout in sorted(scored, key=lambda item: item[0])]
        metrics = detection_metrics(ordered, image_root=self.run.data.image_root)[0].log_dict(metric_key_prefix)
        sums = reduce_values(self.teacher_forced_sums(records, positions).to_list(), "sum", world_size=world,
                             device=self.args.device)
        metrics.update({f"{metric_key_prefix}/{k}": v for k, v in TokenTypeSums.from_list(sums).figures().items()})
        super().log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        # HF's best-model tracking reads eval_<name> (training.metric_for_best_model); the log keeps eval/<name>
        returned = {**metrics, **{f"{metric_key_prefix}_{k.split('/', 1)[1]}": v for k, v in metrics.items()}}
        wanted = self.args.metric_for_best_model
        if wanted is not None and wanted not in returned:
            raise LaunchError(f"training.metric_for_best_model {wanted!r} was not computed at step {step} (segm_* "
                              "need polygon ground truth; AP by size needs objects of that size in the validation set; "
                              "coord_token_* need objects)",
                              hint="Choose a figure this validation set always has, such as AP50 or match_rate.")
        return returned

    # -- checkpoints ------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resume with the checkpoint's weights under the model's own names (:mod:`.checkpoint_load`: HF's loader
        matched none of a Qwen-VL checkpoint's legacy names and resumed from the base weights); other layouts
        (adapters, sharded FSDP) go to HF's loader."""
        from coordexp.runtime.train.checkpoint_load import load_checkpoint_weights

        if not load_checkpoint_weights(model if model is not None else self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF's checkpoint, written under a staging directory and renamed into place once every rank has written
        its part (:mod:`.checkpoints`): an interrupted save never leaves a ``checkpoint-N`` behind."""
        run_dir = self._get_output_dir(trial=trial)
        step = int(self.state.global_step)
        staging = str(checkpoints.staging_dir(run_dir, step))
        self._get_output_dir = lambda trial=None: staging  # type: ignore[method-assign]  # HF writes here
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir  # the class's method again
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            final = checkpoints.publish_checkpoint(run_dir, step)
            best = Path(run_dir) / f"checkpoint-{self.state.best_global_step}"
            if self.state.best_global_step and best.is_dir():  # HF looked for it under the staging dir
                self.state.best_model_checkpoint = str(best)
                self.state.save_to_json(str(final / "trainer_state.json"))
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        self.accelerator.wait_for_everyone()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Checkpoints carry the processor too, so a checkpoint loads like any Qwen-VL checkpoint. A README.md of
        the user's stays as it was (PEFT's ``save_pretrained`` rewrites any README it finds)."""
        from coordexp.runtime.train.model_card import kept_user_card, restore_user_card

        out = Path(output_dir or self.args.output_dir)
        kept = kept_user_card(out)
        super()._save(output_dir, state_dict)
        restore_user_card(out, kept)
        from coordexp.runtime.model.checkpoint_files import share_saved_weights

        share_saved_weights(out)  # safetensors writes 0600; 0666 minus the umask, as any file (issue 44)
        processor = self.host.processor
        if hasattr(processor, "save_pretrained"):
            processor.save_pretrained(str(out))
        else:
            family = self.accelerator.unwrap_model(self.model).config.model_type
            save_processor(out, family, processor.tokenizer, processor.image_processor)


def _file_eval_figures_under_eval(trainer: Any) -> None:
    """transformers' TensorBoard callback files every key without an ``eval_`` prefix under ``train/``; the
    trainer logs evaluations as ``eval/<name>`` (trainer_state.json keeps that name), so they are handed to it as
    ``eval_<name>``, which it files under ``eval/<name>``."""
    for callback in list(trainer.callback_handler.callbacks):
        if isinstance(callback, TensorBoardCallback) and not isinstance(callback, _EvalTagsTensorBoard):
            trainer.callback_handler.remove_callback(callback)
            trainer.callback_handler.add_callback(_EvalTagsTensorBoard(tb_writer=callback.tb_writer))


class _EvalTagsTensorBoard(TensorBoardCallback):
    """:func:`_file_eval_figures_under_eval`'s callback (text values, such as the final window's tag, skipped)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        renamed = {("eval_" + k[5:] if str(k).startswith("eval/") else k): v for k, v in (logs or {}).items()
                   if not isinstance(v, str)}
        return super().on_log(args, state, control, logs=renamed, **kwargs)


def _warn_line(message: str) -> None:
    """A warning line on stderr, unwrapped (a pipe's 80 columns never split it), markup-free."""
    from rich.console import Console

    Console(stderr=True, highlight=False).print(f"! {message}", markup=False, soft_wrap=True, style="yellow")


"""Offload inside a training step (issue 12 item 6): stage 2 with colocated vLLM rollouts and
``rollout_matching.offload`` on, so every rollout runs inside the offload context in the middle of
``training_step``. On CPU the offload target is the training device itself, so nothing moves
(``tensors_moved == 0``; the device round trip is tested on CUDA in test_offload.py); what this checks on CPU is
that the context really runs inside the step with the trainer's own model and optimizer, and that every parameter,
buffer, gradient and optimizer-state tensor is, after the rollout, the same object with the same storage and the
same bits as before it; and that training with offload on ends bit-identical to training with it off."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pytest
import torch

from coordexp.runtime.rollout import vllm_colocate
from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
from coordexp.schema.contract import VllmColocateContract, load_contract

from .conftest import SKIP_REASON, VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)]
OFFLOAD_BOTH = {"enabled": True, "offload_model": True, "offload_optimizer": True}


def _state_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor the offload context may move, by a stable name: parameters, their grads, buffers, and each
    optimizer-state entry (keyed by the parameter's name)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        tensors[f"param:{name}"] = parameter
        if parameter.grad is not None:
            tensors[f"grad:{name}"] = parameter.grad
    for name, buffer in model.named_buffers():
        tensors[f"buffer:{name}"] = buffer
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim:{names[id(parameter)]}:{key}"] = value
    return tensors


@dataclass
class Snapshot:
    """Values (cloned), object identities and storage pointers of the training state at one moment."""

    values: dict[str, torch.Tensor]
    objects: dict[str, int]
    storage: dict[str, int]
    state_dicts: dict[str, int]

    @classmethod
    def take(cls, model, optimizer) -> "Snapshot":
        tensors = _state_tensors(model, optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        return cls(values={k: t.detach().clone() for k, t in tensors.items()},
                   objects={k: id(t) for k, t in tensors.items()},
                   storage={k: t.data_ptr() for k, t in tensors.items()},
                   state_dicts={names[id(p)]: id(s) for p, s in optimizer.state.items()})

    def differences(self, model, optimizer) -> list[str]:
        """What is no longer as it was: missing/new tensors, other objects, other storage, other bits."""
        now = Snapshot.take(model, optimizer)
        problems = [f"{k}: missing after the rollout" for k in self.values.keys() - now.values.keys()]
        problems += [f"{k}: appeared during the rollout" for k in now.values.keys() - self.values.keys()]
        for key in self.values.keys() & now.values.keys():
            if now.objects[key] != self.objects[key]:
                problems.append(f"{key}: a different tensor object")
            if now.storage[key] != self.storage[key]:
                problems.append(f"{key}: different storage")
            before, after = self.values[key], now.values[key]
            if before.dtype != after.dtype or before.shape != after.shape or not torch.equal(before, after):
                problems.append(f"{key}: different values")
        if now.state_dicts != self.state_dicts:
            problems.append("the optimizer's per-parameter state dicts were replaced")
        return problems


@dataclass
class OffloadRecord:
    """One pass through the offload context during training."""

    in_training_step: bool
    global_step: int
    active: bool
    optimizer: object
    tensors: int  # how many state tensors it covered (params, grads, buffers, optimizer state)
    optimizer_tensors: int
    grads: int
    moved: int = -1
    problems: list[str] = field(default_factory=list)


def _train(write_run_config, engine, processor, tmp_path, *, offload: bool, monkeypatch=None):
    """Two optimizer steps of stage 2 (batch 2, accumulation 2) on the shared engine; with ``monkeypatch``,
    every offload context is recorded. Returns (trainer, records)."""
    from coordexp.runtime.train.launch import build_trainer

    overrides = {
        "training": {"output_dir": str(tmp_path / ("on" if offload else "off")), "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 2, "max_steps": 2, "logging_steps": 1, "save_steps": 1000,
                     "learning_rate": 1e-2, "seed": 3},
        "rollout_matching": {"offload": OFFLOAD_BOTH if offload else {"enabled": False}},
    }
    run = load_contract(write_run_config(overrides, name=f"offload_{offload}.yaml"))
    assert isinstance(run.rollout_matching.backend, VllmColocateContract)
    assert run.rollout_matching.offload_active is offload
    trainer = build_trainer(run)
    trainer.backend.close()  # lazily built, never started; the session engine is shared instead
    trainer.backend = VllmColocateBackend.from_run(run, trainer.model, processor, engine=engine)
    records: list[OffloadRecord] = []
    if monkeypatch is not None:
        in_step = [False]
        real_step = trainer.training_step

        def training_step(*args, **kwargs):
            in_step[0] = True
            try:
                return real_step(*args, **kwargs)
            finally:
                in_step[0] = False

        monkeypatch.setattr(trainer, "training_step", training_step)
        real_context = vllm_colocate.offload_context

        @contextlib.contextmanager
        def recording_context(model, optimizer, config, *, active, **kwargs):
            before = Snapshot.take(model, optimizer)
            keys = before.values.keys()
            record = OffloadRecord(in_training_step=in_step[0], global_step=trainer.state.global_step, active=active,
                                   optimizer=optimizer, tensors=len(keys),
                                   optimizer_tensors=sum(k.startswith("optim:") for k in keys),
                                   grads=sum(k.startswith("grad:") for k in keys))
            with real_context(model, optimizer, config, active=active, **kwargs) as report:
                yield report
            record.moved = report.tensors_moved
            record.problems = before.differences(model, optimizer)
            records.append(record)

        monkeypatch.setattr(vllm_colocate, "offload_context", recording_context)
    trainer.train()
    assert trainer.state.global_step == 2
    return trainer, records


def test_offload_inside_a_training_step_returns_every_tensor_bit_equal(write_run_config, restore_engine, processor,
                                                                       tmp_path, monkeypatch):
    trainer, records = _train(write_run_config, restore_engine, processor, tmp_path, offload=True,
                              monkeypatch=monkeypatch)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps the torch optimizer
    assert len(records) == 2  # one rollout call per optimizer step (both micro-steps' prompts at its sync point)
    for record in records:
        assert record.in_training_step and record.active
        assert record.optimizer is optimizer  # the trainer handed the backend its real optimizer
        assert record.problems == []
        assert record.moved == 0  # CPU: the offload target is the training device, so nothing has to move
    # the comparison covered optimizer state (after the first optimizer step), not only parameters; the whole step
    # rolls out before its first backward, so no gradient is in flight
    after_first_step = [r for r in records if r.global_step >= 1]
    assert after_first_step and all(r.optimizer_tensors > 0 for r in after_first_step)
    assert all(r.grads == 0 for r in records)
    assert trainer.backend.pushes >= 2  # the rollouts inside the context pushed weights into the engine


def test_training_with_offload_ends_bit_identical_to_training_without(write_run_config, restore_engine, processor,
                                                                       tmp_path):
    with_offload, _ = _train(write_run_config, restore_engine, processor, tmp_path, offload=True)
    without, _ = _train(write_run_config, restore_engine, processor, tmp_path, offload=False)
    on = dict(with_offload.model.named_parameters())
    off = dict(without.model.named_parameters())
    assert on.keys() == off.keys()
    changed = [n for n in on if not torch.equal(on[n].detach(), off[n].detach())]
    assert changed == []
    optim_on = getattr(with_offload.optimizer, "optimizer", with_offload.optimizer).state_dict()["state"]
    optim_off = getattr(without.optimizer, "optimizer", without.optimizer).state_dict()["state"]
    assert optim_on.keys() == optim_off.keys() and optim_on
    for index, state in optim_on.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(optim_off[index][key])), (index, key)

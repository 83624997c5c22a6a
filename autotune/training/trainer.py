"""One configuration's training state, as trials and the probe train it: the user's model, prepared, and optimizer."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports

from autotune.device import Backend, autocast_type, backend_for, host_memory_apart
from autotune.errors import UsageError
from autotune.meters.tensor import enter_device, meter_aside
from autotune.training.host_state import HostState, OnHost, built_on_host, wrap_bytes
from autotune.plans.offload import offloader_of
from autotune.records import Config, GuardRails
from autotune.training.applied import Applied, prepare
from autotune.training.compiled import compile_model, mark_batch_dynamic
from autotune.training.optimizer import prime as prime_optimizer
from autotune.training.workload import Workload, move_model
from autotune.vocabulary import PRECISIONS

if TYPE_CHECKING:
    from autotune.training.wrapping import Wrapping

__all__ = ["Trainer"]


class Trainer:
    """One configuration's training state: a fresh model prepared as :func:`autotune.apply` does, the workload's
    optimizer (AdamW unless the user gave one).

    Used by trials and the probe. Each step is the loop a user of :func:`autotune.apply` runs
    (autocast, backward through the GradScaler, :meth:`Applied.step`); the trainer records losses,
    the loss-scale history, skipped steps and (when asked) gradient norms.
    """

    def __init__(self, workload: Workload, config: Config, device: torch.device, *, lr: float = 1e-4, seed: int = 0,
                 guard: GuardRails = GuardRails(), record_grad_norm: bool = False,
                 parallel: "Wrapping | None" = None, host_budget_bytes: int | None = None,
                 host_apart: bool | None = None) -> None:
        self.workload, self.config, self.device, self.guard = workload, config, device, guard
        # whether the device's memory is not the host's, where the model is built: CUDA's; a CUDA prediction on the
        # CPU says so of the CPU's tensors that stand for the GPU's (default: the device's own kind)
        self.host_apart = host_memory_apart(device) if host_apart is None else host_apart
        self.parallel = parallel  # --parallel: the trial's process group and wrapper
        self.backend: Backend = backend_for(device)
        self.lr, self.seed, self.record_grad_norm = lr, seed, record_grad_norm
        self.host_budget_bytes = host_budget_bytes  # what an offloading plan may hold in host memory
        self.losses: list[float] = []
        self.ballast: list[torch.Tensor] = []  # the optimizer's state-to-be, until its first step (prime)
        self.unprimed: str | None = None  # why the optimizer could not be primed: its state comes with a step
        self.run: Applied | None = None
        self.plan: dict[str, Any] = {}
        self.host_state: HostState | None = None  # a PLAN+state: the state in host memory under FSDP2

    def build(self, *, prime: bool = True) -> None:
        """Build the model (seeded), prepare it (fp32 modules, checkpoint plan), make the optimizer and its state.

        With ``prime`` the optimizer's state exists before the first step (as ballast of its size,
        :func:`autotune.training.optimizer.prime`), so that step already holds what every later step
        holds: one metered step sees the steady peak.
        """
        state = self.config.plan.state  # the state in host memory: FSDP2 moves each block as it shards it
        if state and self.parallel is None:
            raise UsageError(f"plan {self.config.plan} keeps FSDP2's sharded state in host memory: it trains under "
                             f"--parallel fsdp (torchrun, one rank is enough)")
        precision = PRECISIONS[self.config.precision]
        if precision.fsdp_only and self.parallel is None:
            raise UsageError(f"precision {precision.name} is FSDP2's {precision.policy}: it trains under --parallel "
                             f"fsdp (torchrun, one rank is enough)")
        with built_on_host(self.device) if state else contextlib.nullcontext() as host:
            model = self._prepared(host)
            self.optimizer = self.workload.optimizer.make(model, self.lr)  # the wrapper's parameters (FSDP2's: shards)
            if prime:
                primed = prime_optimizer(self.optimizer)
                self.ballast = primed.ballast
                self.unprimed = None if primed.failure is None else f"{type(primed.failure).__name__}: {primed.failure}"
            if host is not None:
                host.on_device.extend(model.buffers())  # the device's, where FSDP2 moved them
                host.on_host.extend([*model.parameters(), *self.ballast])  # the shards and the state-to-be
        if state:
            self.host_state = HostState(model, self.optimizer, self.ballast, self.device,
                                        host_budget_bytes=self.host_budget_bytes, activations=offloader_of(model))
            self.host_state.install()

    def _prepared(self, host: OnHost | None) -> torch.nn.Module:
        """The model, built (seeded), prepared, on its device and under the job's wrapper; ``host`` for a plan
        ``+state``, whose model stays on the host for FSDP2 to shard there.

        A CUDA prediction on the CPU (``host_apart`` on a CPU device) builds and prepares the model outside the tensor
        meter, as a GPU's trial builds it in host memory, and counts its parameters and buffers from its move: a
        bf16-true model built in float32 holds its float32 weights on the host only."""
        aside = self.parallel is None and self.host_apart and not host_memory_apart(self.device)
        with meter_aside() if aside else contextlib.nullcontext():
            if self.parallel is None:
                model, meta = self.workload.build_model(seed=self.seed), None  # the same seeded model (a copy once warm)
            else:  # DDP's whole; FSDP2's on the meta device, its shards made on the device by the wrap (wrapping.py)
                built = self.parallel.build(self.workload, self.seed, offload_state=host is not None)
                model, meta = built.model, built.meta
            self.run = prepare(model, precision=self.config.precision, plan=self.config.plan,
                               chain=self.workload.chain, guard=self.guard, device_type=autocast_type(self.device),
                               micro_batch_size=self.config.batch_size, record_loss_scale=True,
                               record_grad_norm=self.record_grad_norm, host_budget_bytes=self.host_budget_bytes,
                               record_lost_updates=self.record_grad_norm)  # the probe's: bf16-true's rounding
        self.plan = self.run.plan
        blocks = self.workload.chain.blocks if self.workload.chain else ()
        if host is not None:
            host.wrap_bytes = wrap_bytes(model, blocks, self.parallel.job.world_size)
        elif meta is None:
            move_model(model, self.device)
            if aside:  # on the device from here: what the move would have allocated there
                enter_device([*model.parameters(), *model.buffers()])
        self.module = model  # the user's module (batches come from its example_batch), under any wrapper
        if self.parallel is not None:  # DDP, or FSDP2 on each repeated block and the root, on the trial's group
            self.run.model = self.parallel.wrap(model, blocks, offload_state=host is not None, meta=meta,
                                                precision=self.config.precision)
        self.run.model = compile_model(self.run.model, self.config.compile)  # compiled outermost, as users do
        return model

    @property
    def holds_state(self) -> bool:
        """Whether the optimizer's state (or the ballast standing in for it) exists: a step now is a steady one."""
        return bool(self.ballast) or bool(self.optimizer.state)

    @property
    def host_peak_bytes(self) -> int | None:
        """The most an offloading plan's host copies held at once so far, plus the most a ``PLAN+state``'s state held
        (a bound on what both held at once); None for a plan that keeps nothing in host memory."""
        offloader = offloader_of(self.module) if getattr(self, "module", None) is not None else None
        if offloader is None and self.host_state is None:
            return None
        return (offloader.host_peak_bytes if offloader else 0) + (self.host_state.host_bytes if self.host_state else 0)

    @property
    def model(self) -> torch.nn.Module:
        return self.run.model

    @property
    def uses_scaler(self) -> bool:
        return self.run is not None and self.run.scaler is not None

    @property
    def scales(self) -> list[float]:
        """fp16: the GradScaler's scale after each step."""
        return self.run.loss_scales if self.run is not None else []

    @property
    def skipped(self) -> int:
        """fp16: steps the GradScaler skipped (inf/NaN gradients)."""
        return self.run.skipped_steps if self.run is not None else 0

    @property
    def grad_norms(self) -> list[float]:
        return self.run.grad_norms if self.run is not None else []

    @property
    def lost_updates(self) -> dict[str, float] | None:
        """bf16-true under the probe: of the sampled entries with a nonzero gradient over the steps, the share whose
        update rounded away (``share``), and the counts (``lost``, ``sampled``); None for the other precisions."""
        if self.run is None or not self.run.record_lost_updates or not self.run.updates_sampled:
            return None
        run = self.run
        return {"share": run.updates_lost / run.updates_sampled, "lost": run.updates_lost, "sampled": run.updates_sampled}

    def release(self) -> None:
        """Drop the model, optimizer, scaler and batch; keep the records."""
        if self.run is not None:
            self.run.model = self.run.scaler = None
        if self.host_state is not None:  # its hooks and step hold the model and optimizer where the gc cannot see
            self.host_state.close()
        self.ballast = []
        for name in ("optimizer", "batch", "module"):
            self.__dict__.pop(name, None)

    def step(self, batch: Any, *, micro_steps: int = 1) -> None:
        """One optimizer step on ``batch`` (already on the device), after ``micro_steps`` forward and backward passes
        of it (gradient accumulation: each loss divided by their count, as autotune.apply's loop divides it)."""
        mark_batch_dynamic(batch, self.config.batch_size, self.config.compile)  # compiled: one graph for every size
        for _ in range(micro_steps):
            with self.run.autocast():
                loss = self.workload.loss(self.run.model, batch)
                if micro_steps > 1:  # the divided loss alone held, as the loop's ``loss = ... / steps``
                    loss = loss / micro_steps
            self.run.backward(loss)
        self.run.step(self.optimizer)
        if self.host_state is not None:
            self.host_state.end_step()
        if not is_fake(loss):  # a dry run's loss has a shape and no value (autotune.execution.predict)
            self.losses.append(float(loss.detach()) * micro_steps)

    def timed_step(self, batch: Any) -> float:
        """One step, timed to completion on the device; return its seconds."""
        return self.backend.timed(lambda: self.step(batch))


"""One real, short training run of one configuration: its peak memory, step time and outcome."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from autotune._log import logger
from autotune.training.applied import Applied, prepare
from autotune.training.data import real_tokens
from autotune.device import Backend, backend_for
from autotune.errors import TrialTimeoutError, UsageError, first_line, is_device_crash, is_oom
from autotune.meters import Meter
from autotune.records import Config, GuardRails, Measurement, TrialSettings, settled, timing_fields
from autotune.training.workload import Workload, to_device

if TYPE_CHECKING:
    from autotune.execution.distributed import Wrapping

__all__ = ["Trainer", "run_trial", "outcome"]


def outcome(exc: Exception) -> tuple[str, str]:
    """Return the (status, error) a trial records for ``exc``; re-raise bad input (:class:`UsageError`).

    The one place that decides what a failure is: trials, the probe and isolated workers agree.
    """
    if isinstance(exc, UsageError):
        raise exc
    if isinstance(exc, TrialTimeoutError):
        return "timeout", str(exc)
    if is_oom(exc):
        return "oom", first_line(exc)
    if is_device_crash(exc):  # a sticky CUDA error: the device is unusable, as if the worker had died
        return "crashed", f"{type(exc).__name__}: {first_line(exc)}"
    return "failed", f"{type(exc).__name__}: {first_line(exc)}"


class Trainer:
    """One configuration's training state: a fresh model prepared as :func:`autotune.apply` does, AdamW.

    Used by trials and the probe. Each step is the loop a user of :func:`autotune.apply` runs
    (autocast, backward through the GradScaler, :meth:`Applied.step`); the trainer records losses,
    the loss-scale history, skipped steps and (when asked) gradient norms.
    """

    def __init__(self, workload: Workload, config: Config, device: torch.device, *, lr: float = 1e-4, seed: int = 0,
                 guard: GuardRails = GuardRails(), record_grad_norm: bool = False,
                 parallel: "Wrapping | None" = None) -> None:
        self.workload, self.config, self.device, self.guard = workload, config, device, guard
        self.parallel = parallel  # --parallel: the trial's process group and wrapper
        self.backend: Backend = backend_for(device)
        self.lr, self.seed, self.record_grad_norm = lr, seed, record_grad_norm
        self.losses: list[float] = []
        self.run: Applied | None = None
        self.plan: dict[str, Any] = {}

    def build(self, *, prime: bool = True) -> None:
        """Build the model (seeded), prepare it (fp32 modules, checkpoint plan), make the optimizer and its state.

        With ``prime`` the optimizer's state exists before the first step (:meth:`prime`), so that
        step already holds what every later step holds: one metered step sees the steady peak.
        """
        torch.manual_seed(self.seed)
        model = self.workload.build_model()
        self.run = prepare(model, precision=self.config.precision, segments=self.config.segments,
                           chain=self.workload.chain, guard=self.guard, device_type=self.device.type,
                           micro_batch_size=self.config.batch_size, record_loss_scale=True,
                           record_grad_norm=self.record_grad_norm)
        self.plan = self.run.plan
        model.to(self.device)
        self.module = model  # the user's module (batches come from its example_batch), under any wrapper
        if self.parallel is not None:  # DDP, or FSDP2 on each repeated block and the root, on the trial's group
            self.run.model = self.parallel.wrap(model, self.workload.chain.blocks if self.workload.chain else ())
        self.optimizer = torch.optim.AdamW(self.run.model.parameters(), lr=self.lr)  # FSDP2's: the shards
        if prime:
            self.prime()

    def prime(self) -> None:
        """Create the optimizer's state with a step that changes nothing, then make it a fresh optimizer's again.

        AdamW creates its moments in its first step, so without this the first step of a trial
        peaks lower than every later one (and in fp16 a step the GradScaler skips creates none).
        The step here runs on zero gradients at learning rate 0: parameters and moments stay
        exactly as they were (zero), and the step counters go back to 0, so training goes on
        bitwise as from a fresh optimizer.
        """
        groups = self.optimizer.param_groups
        for group in groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        rates = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for group, lr in zip(groups, rates):
            group["lr"] = lr
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0
        self.optimizer.zero_grad(set_to_none=True)

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

    def release(self) -> None:
        """Drop the model, optimizer, scaler and batch; keep the records."""
        if self.run is not None:
            self.run.model = self.run.scaler = None
        for name in ("optimizer", "batch", "module"):
            self.__dict__.pop(name, None)

    def step(self, batch: Any) -> None:
        """One optimizer step on ``batch`` (already on the device)."""
        with self.run.autocast():
            loss = self.workload.loss(self.run.model, batch)
        self.run.backward(loss)
        self.run.step(self.optimizer)
        self.losses.append(float(loss.detach()))

    def timed_step(self, batch: Any) -> float:
        """One step, timed to completion on the device; return its seconds."""
        return self.backend.timed(lambda: self.step(batch))


class _Run(Trainer):
    """A trial: the trainer, its worst batch (memory) and its random batches (timed steps)."""

    def __init__(self, workload: Workload, config: Config, device: torch.device, settings: TrialSettings,
                 parallel: "Wrapping | None" = None) -> None:
        super().__init__(workload, config, device, lr=settings.lr, seed=settings.seed, guard=settings.guard,
                         parallel=parallel)
        self.settings = settings
        self.step_times: list[float] = []
        self.tokens: list[int | None] = []  # real tokens of each timed step's batch

    def build(self) -> None:
        super().build()
        self.batch = to_device(self.workload.make_batch(self.module, self.config.batch_size), self.device)

    def timed_steps(self, deadline: float | None) -> None:
        """Time steps on random batches of the data (the same draws for every configuration of this batch size).

        At most ``measure_steps``; fewer once the last ``settle_steps`` lie within ``settle_share`` of
        their median (the time has settled: more steps would not move the median).
        """
        late = False  # with --parallel, whether any rank would run past its time limit (agreed after each step)
        for draw in range(self.settings.measure_steps):
            if settled(self.step_times, self.settings.settle_steps, self.settings.settle_share):
                break
            projected = self.step_times[-1] if self.step_times else 0.0
            if late or (deadline is not None and time.monotonic() + projected > deadline):
                raise TrialTimeoutError(f"the trial would run past its {self.settings.timeout_s:g} s limit (--trial-timeout)")
            batch = self.batch if self.workload.dataset is None else to_device(
                self.workload.sample_batch(self.module, self.config.batch_size, draw, seed=self.seed), self.device)
            self.tokens.append(real_tokens(batch))
            seconds = self.timed_step(batch)
            if self.parallel is not None:  # every rank keeps the slowest rank's time, and stops where the others do
                seconds, late = self.parallel.slowest(
                    seconds, deadline is not None and time.monotonic() + seconds > deadline)
            self.step_times.append(seconds)
            self._log_step("timed", self.step_times[-1])

    def _log_step(self, kind: str, seconds: float | None = None) -> None:
        """One line per step with --verbose: the step's time, its loss and, in fp16, the loss scale."""
        if logger.isEnabledFor(logging.DEBUG):
            scale = f", loss scale {self.scales[-1]:g}" if self.scales else ""
            took = f" {seconds:.4f} s," if seconds is not None else ""
            logger.debug("  %s %s step %d:%s loss %.4g%s", self.config, kind, len(self.losses), took, self.losses[-1], scale)



def run_trial(
    workload: Workload,
    config: Config,
    *,
    device: torch.device | str,
    meter: Meter,
    settings: TrialSettings = TrialSettings(),
    timed: bool = True,
    metered: bool = True,
    parallel: "Wrapping | None" = None,
) -> Measurement:
    """Train ``config`` for a few steps on a fresh model and optimizer; return what was measured.

    ``timed=False`` makes a memory trial: the metered steps only, no timed steps (no samples/s).
    ``metered=False`` (for a meter that slows steps, the tensor meter) times without the meter: the
    timing that completes an earlier memory trial of the configuration (:func:`records.completed`).
    ``parallel`` (:mod:`autotune.execution.distributed`) trains this rank's part of a distributed trial.
    Out-of-memory, time-outs, a crashed device and errors in the user's model are outcomes (status
    ``oom``, ``timeout``, ``crashed``, ``failed``), not exceptions; bad input (:class:`UsageError`)
    and ``KeyboardInterrupt`` propagate. Memory is released before returning.
    """
    device = torch.device(device)
    started = time.monotonic()
    deadline = started + settings.timeout_s if settings.timeout_s else None
    run = _Run(workload, config, device, settings, parallel)
    status, error, handle = "ok", None, None
    # The tensor meter slows every op down: it sees one step (the optimizer's state primed: one step
    # holds all a step holds), and the timed steps run after it without the meter.
    warmup = 1 if meter.slows_steps else settings.warmup_steps
    timed_inside = timed and metered and not meter.slows_steps  # a meter that costs nothing times in its region
    try:
        with meter.measure(deadline=deadline) if metered else contextlib.nullcontext() as handle:
            run.build()
            for _ in range(warmup):
                run.step(run.batch)
                run._log_step("warm-up (metered)" if metered and meter.slows_steps else "warm-up")
            if timed_inside:
                run.timed_steps(deadline)
        if timed and not timed_inside:
            run.timed_steps(deadline)
    except Exception as exc:  # noqa: BLE001 - every failure of the user's code is an outcome
        status, error = outcome(exc)
    finally:
        records = (run.plan, run.losses, list(run.scales), run.skipped, run.step_times, run.tokens)
        run.release()
        del run  # model, optimizer, batch and activations go with it
        backend_for(device).release()
    return _measurement(config, status, error, records, handle.reading if handle is not None else None, started, timed)


def _measurement(config: Config, status: str, error: str | None, records: tuple, reading: Any,
                 started: float, timed: bool) -> Measurement:
    """The trial's :class:`Measurement` from its records and the meter's reading."""
    plan, losses, scales, skipped, step_times, tokens = records
    ok = status == "ok"
    real = sum(tokens) if tokens and None not in tokens else None
    return Measurement(
        config=config,
        status=status,
        peak_bytes=reading.peak_bytes if reading else None,
        peak_allocated_bytes=reading.peak_allocated_bytes if reading else None,
        peak_reserved_bytes=reading.peak_reserved_bytes if reading else None,
        peak_nvml_bytes=reading.peak_nvml_bytes if reading else None,
        oom_held_bytes=getattr(reading, "oom_held_bytes", None),
        oom_needed_bytes=getattr(reading, "oom_needed_bytes", None),
        memory_source=reading.source if reading else "",
        **timing_fields(config.batch_size, tuple(step_times), real, ok),
        loss_first=losses[0] if losses else None,
        loss_final=losses[-1] if losses else None,
        nonfinite_losses=sum(not math.isfinite(v) for v in losses),
        loss_scale_history=tuple(scales),
        skipped_steps=skipped,
        plan=plan,
        error=error,
        wall_s=time.monotonic() - started,
        timed=timed,
    )

"""One real, short training run of one configuration: its peak memory, step time and outcome."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import statistics
import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autotune._log import logger
from autotune.data import real_tokens
from autotune.checkpointing import apply_plan
from autotune.errors import TrialTimeoutError, UsageError, first_line, is_oom
from autotune.meters import Meter
from autotune.plans import canonical
from autotune.precision import get_mode
from autotune.space import Config
from autotune.workload import Workload, to_device

__all__ = ["STATUSES", "TrialSettings", "GuardRails", "Measurement", "Trainer", "run_trial", "release_memory", "keep_in_fp32"]

STATUSES = ("ok", "oom", "timeout", "failed", "crashed")  # crashed: its worker process died


@dataclasses.dataclass(frozen=True)
class GuardRails:
    """Numerical guard rails from the practitioner's guide, applied in trials, probes and ``apply``."""

    clip_grad_norm: float | None = None  # clip the global gradient norm to this (after unscaling fp16)
    fp32_modules: tuple[str, ...] = ()  # module class names kept outside autocast (numerically sensitive)

    def to_dict(self) -> dict[str, Any]:
        return {"clip_grad_norm": self.clip_grad_norm, "fp32_modules": list(self.fp32_modules)}


@dataclasses.dataclass(frozen=True)
class TrialSettings:
    """How long each trial trains and how it is cut short."""

    warmup_steps: int = 2  # untimed; on the tensor meter they are the metered steps (at least 2)
    measure_steps: int = 5  # timed with device synchronisation; the median is reported
    timeout_s: float | None = 300.0  # a trial running longer is stopped with status "timeout"
    lr: float = 1e-4  # AdamW learning rate; memory and step time do not depend on it
    seed: int = 0  # the same initial weights and dropout masks for every trial
    guard: GuardRails = GuardRails()  # gradient clipping and fp32 modules: part of how a trial trains


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one trial measured. Times in seconds, memory in bytes; ``None`` where not reached."""

    config: Config
    status: str  # "ok", "oom", "timeout", "failed" or "crashed" (see STATUSES)
    peak_bytes: int | None = None  # compared to the budget: tracked tensors (CPU) or CUDA reserved
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_nvml_bytes: int | None = None
    memory_source: str = ""  # "tensor" or "cuda"
    step_s: float | None = None  # median of the measured steps
    step_times_s: tuple[float, ...] = ()
    samples_per_s: float | None = None
    step_s_spread: float | None = None  # (slowest - fastest) / median of the timed steps, on their different batches
    tokens_per_s: float | None = None  # real tokens (attention_mask, or labels not -100) over the timed steps' time
    loss_first: float | None = None
    loss_final: float | None = None
    nonfinite_losses: int = 0
    loss_scale_history: tuple[float, ...] = ()  # fp16: the GradScaler's scale after each step
    skipped_steps: int = 0  # fp16: steps the scaler skipped because gradients held inf/NaN
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    wall_s: float = 0.0

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def segments(self) -> str:
        return self.config.segments

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def fits(self, budget_bytes: int | None) -> bool:
        """True when the trial ran to the end and its peak stays within ``budget_bytes``."""
        return self.status == "ok" and (budget_bytes is None or (self.peak_bytes or 0) <= budget_bytes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["step_times_s"] = list(self.step_times_s)
        data["loss_scale_history"] = list(self.loss_scale_history)
        return flatten_config(data, floats=("loss_first", "loss_final"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        config, kwargs = unflatten_config(cls, data, floats=("loss_first", "loss_final"))
        kwargs["step_times_s"] = tuple(kwargs.get("step_times_s", ()))
        kwargs["loss_scale_history"] = tuple(kwargs.get("loss_scale_history", ()))
        return cls(config=config, **kwargs)


def flatten_config(data: dict[str, Any], *, floats: tuple[str, ...]) -> dict[str, Any]:
    """A dataclass dict with its ``config`` spread into the top level, JSON-safe.

    Strict JSON has no NaN or inf: the ``floats`` fields keep them as text ("nan", "inf").
    """
    config = data.pop("config")
    for key in floats:
        if data.get(key) is not None and not math.isfinite(data[key]):
            data[key] = str(data[key])
    return {**config, **data}


def unflatten_config(cls: type, data: dict[str, Any], *, floats: tuple[str, ...]) -> tuple[Config, dict[str, Any]]:
    """The inverse of :func:`flatten_config`: the Config and the keyword arguments ``cls`` knows."""
    data = dict(data)
    config = Config(data.pop("precision"), canonical(data.pop("segments")), int(data.pop("batch_size")))
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in fields}
    for key in floats:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = float(kwargs[key])
    return config, kwargs


def release_memory(device: torch.device) -> None:
    """Free what a finished trial left: reference cycles, and on CUDA the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels run asynchronously: time them to completion


def keep_in_fp32(model: torch.nn.Module, class_names: tuple[str, ...], device_type: str) -> list[str]:
    """Run every module whose class is named in ``class_names`` outside autocast, on float32 inputs.

    Returns the paths of the modules changed; raises :class:`UsageError` for a name the model lacks.
    """
    if not class_names:
        return []
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in class_names if n not in present]
    if missing:
        raise UsageError(
            f"--fp32-modules {','.join(missing)}: {type(model).__name__} has no module of that type "
            f"(it has {', '.join(sorted(present)[:12])}{', ...' if len(present) > 12 else ''})"
        )
    changed = []
    for path, module in model.named_modules():
        if type(module).__name__ in class_names:
            module.forward = functools.partial(_fp32_forward, module.forward, device_type)
            changed.append(path)
    return changed


def _fp32_forward(forward: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
    def up(t: Any) -> Any:
        return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    with torch.autocast(device_type, enabled=False):
        return forward(*tree_map(up, args), **tree_map(up, kwargs))


class Trainer:
    """One configuration's training state: a fresh model with its plan, AdamW and the GradScaler.

    Used by trials, the probe and :func:`autotune.apply`; records losses, the loss-scale history,
    skipped steps and (when asked) gradient norms.
    """

    def __init__(self, workload: Workload, config: Config, device: torch.device, *, lr: float = 1e-4, seed: int = 0,
                 guard: GuardRails = GuardRails(), record_grad_norm: bool = False) -> None:
        self.workload, self.config, self.device, self.guard = workload, config, device, guard
        self.mode = get_mode(config.precision)
        self.lr, self.seed, self.record_grad_norm = lr, seed, record_grad_norm
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.grad_norms: list[float] = []
        self.skipped = 0
        self.plan: dict[str, Any] = {}

    def build(self) -> None:
        """Build the model (seeded), apply the guard rails and the checkpoint plan, make the optimizer."""
        torch.manual_seed(self.seed)
        self.model = self.workload.build_model()
        keep_in_fp32(self.model, self.guard.fp32_modules, self.device.type)
        self.plan = apply_plan(self.model, self.config.segments, self.workload.chain).to_dict()
        self.model.to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.scaler = self.mode.grad_scaler(self.device.type)

    def release(self) -> None:
        """Drop the model, optimizer, scaler and batch; keep the records."""
        for name in ("model", "optimizer", "scaler", "batch"):
            self.__dict__.pop(name, None)

    def step(self, batch: Any) -> None:
        """One optimizer step on ``batch`` (already on the device)."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.mode.autocast(self.device.type):
            loss = self.workload.loss(self.model, batch)
        if self.scaler is None:
            loss.backward()
            self._clip_and_record()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            if self.guard.clip_grad_norm is not None or self.record_grad_norm:
                self.scaler.unscale_(self.optimizer)  # clip and report the true gradients, not scaled ones
            self._clip_and_record()
            self.scaler.step(self.optimizer)
            before = self.scaler.get_scale()
            self.scaler.update()
            scale = self.scaler.get_scale()
            self.scales.append(scale)
            self.skipped += scale < before  # the scaler halves its scale exactly when it skips a step
        self.losses.append(float(loss.detach()))

    def timed_step(self, batch: Any) -> float:
        """One step, timed to completion on the device; return its seconds."""
        _sync(self.device)
        start = time.perf_counter()
        self.step(batch)
        _sync(self.device)
        return time.perf_counter() - start

    def _clip_and_record(self) -> None:
        if self.guard.clip_grad_norm is None and not self.record_grad_norm:
            return
        max_norm = self.guard.clip_grad_norm if self.guard.clip_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.record_grad_norm:
            self.grad_norms.append(float(norm))


class _Run(Trainer):
    """A trial: the trainer, its worst batch (memory) and its random batches (timed steps)."""

    def __init__(self, workload: Workload, config: Config, device: torch.device, settings: TrialSettings) -> None:
        super().__init__(workload, config, device, lr=settings.lr, seed=settings.seed, guard=settings.guard)
        self.settings = settings
        self.step_times: list[float] = []
        self.tokens: list[int | None] = []  # real tokens of each timed step's batch

    def build(self) -> None:
        super().build()
        self.batch = to_device(self.workload.make_batch(self.model, self.config.batch_size), self.device)

    def timed_steps(self, deadline: float | None) -> None:
        """Time steps on random batches of the data (the same draws for every configuration of this batch size)."""
        for draw in range(self.settings.measure_steps):
            projected = self.step_times[-1] if self.step_times else 0.0
            if deadline is not None and time.monotonic() + projected > deadline:
                raise TrialTimeoutError(f"the trial would run past its {self.settings.timeout_s:g} s limit (--trial-timeout)")
            batch = self.batch if self.workload.dataset is None else to_device(
                self.workload.sample_batch(self.model, self.config.batch_size, draw, seed=self.seed), self.device)
            self.tokens.append(real_tokens(batch))
            self.step_times.append(self.timed_step(batch))
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
) -> Measurement:
    """Train ``config`` for a few steps on a fresh model and optimizer; return what was measured.

    Out-of-memory, time-outs and errors in the user's model are outcomes (status ``oom``,
    ``timeout``, ``failed``), not exceptions; bad input (:class:`UsageError`) and
    ``KeyboardInterrupt`` propagate. Memory is released before returning.
    """
    device = torch.device(device)
    started = time.monotonic()
    deadline = started + settings.timeout_s if settings.timeout_s else None
    run = _Run(workload, config, device, settings)
    status, error, handle = "ok", None, None
    try:
        with meter.measure(deadline=deadline) as handle:
            run.build()
            # The tensor meter slows every op down: timed steps run after it, and it gets two
            # untimed steps (the optimizer creates its state in the first) to see the steady peak.
            for _ in range(max(settings.warmup_steps, 2 if meter.slows_steps else 0)):
                run.step(run.batch)
                run._log_step("warm-up (metered)" if meter.slows_steps else "warm-up")
            if not meter.slows_steps:
                run.timed_steps(deadline)
        if meter.slows_steps:
            run.timed_steps(deadline)
    except UsageError:
        raise
    except TrialTimeoutError as exc:
        status, error = "timeout", str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure of the user's code is an outcome
        if is_oom(exc):
            status, error = "oom", first_line(exc)
        else:
            status, error = "failed", f"{type(exc).__name__}: {first_line(exc)}"
    finally:
        plan, losses, scales, skipped, step_times = run.plan, run.losses, run.scales, run.skipped, run.step_times
        tokens = run.tokens
        del run  # model, optimizer, batch and activations go with it
        release_memory(device)
    reading = handle.reading if handle is not None else None
    step_s = statistics.median(step_times) if step_times else None
    return Measurement(
        config=config,
        status=status,
        peak_bytes=reading.peak_bytes if reading else None,
        peak_allocated_bytes=reading.peak_allocated_bytes if reading else None,
        peak_reserved_bytes=reading.peak_reserved_bytes if reading else None,
        peak_nvml_bytes=reading.peak_nvml_bytes if reading else None,
        memory_source=reading.source if reading else "",
        step_s=step_s,
        step_times_s=tuple(step_times),
        samples_per_s=config.batch_size / step_s if step_s and status == "ok" else None,
        step_s_spread=(max(step_times) - min(step_times)) / step_s if step_s and len(step_times) > 1 else None,
        tokens_per_s=(sum(tokens) / sum(step_times) if status == "ok" and tokens and None not in tokens
                      and sum(step_times) > 0 else None),
        loss_first=losses[0] if losses else None,
        loss_final=losses[-1] if losses else None,
        nonfinite_losses=sum(not math.isfinite(v) for v in losses),
        loss_scale_history=tuple(scales),
        skipped_steps=skipped,
        plan=plan,
        error=error,
        wall_s=time.monotonic() - started,
    )

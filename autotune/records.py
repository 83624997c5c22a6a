"""The records every stage passes on: configurations, settings, measurements, probe results, checks.

Plain frozen values with their JSON, and the rules that read them (does a trial fit, what a
budget leaves after its headroom, how many micro-batches make a target batch). Nothing here
imports torch: the analysis side (:mod:`autotune.analysis.pareto`, :mod:`autotune.analysis.memory_model`,
:mod:`autotune.search.strategies`, :mod:`autotune.report`) reads a report on a machine without it.
Times are in seconds and memory in bytes, as the field names say.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from autotune.errors import UsageError
from autotune.vocabulary import EAGER, HEADROOM, CheckStatus, Config, Plan, Status

__all__ = [
    "Budget", "PREDICTED", "MEASURED", "Config", "GuardRails", "TrialSettings", "Measurement", "ProbeSettings",
    "ProbeResult", "PlanCheck", "settled", "timing_fields", "completed", "retimed", "usable_bytes", "accumulation_plan",
    "micro_steps",
]

PREDICTED = "predicted"  # a Measurement's memory_source where the trial ran under fake tensors (--dry-run), not for real
MEASURED = "measured"  # a Measurement's time_source where its steps were timed (PREDICTED: by the time model)


def settled(times: list[float] | tuple[float, ...], steps: int, share: float) -> bool:
    """Whether the last ``steps`` step times lie within ``share`` of their median: timing can stop."""
    if steps < 1 or len(times) < steps:
        return False
    last = times[-steps:]
    middle = statistics.median(last)
    return all(abs(t - middle) <= share * middle for t in last)


def timing_fields(batch_size: int, step_times: tuple[float, ...], tokens: int | None, ok: bool) -> dict[str, Any]:
    """A measurement's timing fields from its timed steps: the median step, samples/s, the spread, tokens/s.

    ``tokens`` is the real tokens over all of ``step_times`` (None where unknown).
    """
    n = len(step_times)
    step_s = statistics.median(step_times) if n else None
    return {
        "step_s": step_s,
        "step_times_s": tuple(step_times),
        "samples_per_s": batch_size / step_s if step_s and ok else None,
        "step_s_spread": (max(step_times) - min(step_times)) / step_s if step_s and n > 1 else None,
        "tokens_per_s": tokens / sum(step_times) if ok and tokens is not None and n and sum(step_times) > 0 else None,
        "time_source": MEASURED if step_s else "",
    }


def _tokens(m: "Measurement") -> int | None:
    return None if m.tokens_per_s is None else round(m.tokens_per_s * sum(m.step_times_s))


def completed(memory: "Measurement", timing: "Measurement", memory_trial: int | None) -> "Measurement":
    """A memory trial completed by a later, unmetered timing run of the same configuration: one measurement
    with the memory trial's peaks and the timing run's steps (``memory_from`` names the memory trial)."""
    if timing.status is not Status.OK:
        return timing  # the timing run failed (a time-out, an error): that is the configuration's outcome
    peaks = {f: getattr(memory, f) for f in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                             "peak_nvml_bytes", "memory_source")}
    distributed = timing.distributed
    if distributed and memory.distributed:  # each rank's peak from the memory trial, its step from the timing
        distributed = {**distributed, "ranks": [{**t, "peak_bytes": m["peak_bytes"]} for m, t in
                                                zip(memory.distributed["ranks"], distributed["ranks"])]}
    return dataclasses.replace(timing, **peaks, distributed=distributed, memory_from=memory_trial,
                               wall_s=memory.wall_s + timing.wall_s, **_seconds(memory, timing))


def retimed(earlier: "Measurement", later: "Measurement") -> "Measurement":
    """Two timings of one configuration as one measurement: the steps of both, the median over all of them."""
    if later.status is not Status.OK or earlier.status is not Status.OK or not earlier.timed:
        return later
    times = earlier.step_times_s + later.step_times_s
    a, b = _tokens(earlier), _tokens(later)
    fields = timing_fields(later.batch_size * later.world_size, times, None if a is None or b is None else a + b, True)
    return dataclasses.replace(earlier, **fields, timings=earlier.timings + later.timings,
                               wall_s=earlier.wall_s + later.wall_s, **_seconds(earlier, later))


def _seconds(a: "Measurement", b: "Measurement") -> dict[str, float | None]:
    """The set-up and step seconds of two runs of one configuration, together (None where neither says)."""
    return {f: None if getattr(a, f) is None and getattr(b, f) is None else (getattr(a, f) or 0.0) + (getattr(b, f) or 0.0)
            for f in ("setup_s", "steps_s")}


def usable_bytes(budget_bytes: int | None, headroom: float) -> float | None:
    """Return what a recommendation may use of ``budget_bytes``: the budget less its headroom share."""
    return None if budget_bytes is None else budget_bytes * (1.0 - headroom)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The memory budgets of one run, in bytes: the recommendation's, the extra ones, and the headroom.

    ``bytes`` is the budget a recommendation is made for; trials run under :attr:`enforced`, the
    largest of all (a smaller budget is judged by the peaks measured, from the same trials).
    """

    bytes: int | None  # the recommendation's budget; None: no limit
    extra: tuple[int, ...] = ()  # more budgets recommended for (--budgets), without the budget itself
    headroom: float = HEADROOM  # the share of a budget a recommendation leaves free

    @property
    def enforced(self) -> int | None:
        """The budget trials run under: the largest."""
        return None if self.bytes is None else max((self.bytes, *self.extra))

    @property
    def all(self) -> tuple[int, ...]:
        """The budget and the extra budgets (none without a budget)."""
        return () if self.bytes is None else (self.bytes, *self.extra)


@dataclasses.dataclass(frozen=True)
class GuardRails:
    """Numerical guard rails from the practitioner's guide, applied in trials, probes and ``apply``."""

    clip_grad_norm: float | None = None  # clip the global gradient norm to this (after unscaling fp16)
    fp32_modules: tuple[str, ...] = ()  # module class names kept outside autocast (numerically sensitive)

    def to_dict(self) -> dict[str, Any]:
        return {"clip_grad_norm": self.clip_grad_norm, "fp32_modules": list(self.fp32_modules)}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "GuardRails":
        data = data or {}
        return cls(clip_grad_norm=data.get("clip_grad_norm"), fp32_modules=tuple(data.get("fp32_modules", ())))


@dataclasses.dataclass(frozen=True)
class TrialSettings:
    """How long each trial trains and how it is cut short."""

    warmup_steps: int = 2  # untimed; on the tensor meter one metered step is the warm-up (the optimizer's state primed)
    measure_steps: int = 5  # at most this many timed steps (device synchronised); the median is reported
    settle_steps: int = 3  # timing stops early once this many last steps lie within settle_share of their median
    settle_share: float = 0.02
    timeout_s: float | None = 300.0  # a trial running longer is stopped with status "timeout"
    lr: float = 1e-4  # AdamW learning rate; memory and step time do not depend on it
    seed: int = 0  # the same initial weights and dropout masks for every trial
    guard: GuardRails = GuardRails()  # gradient clipping and fp32 modules: part of how a trial trains
    host_budget_bytes: int | None = None  # what offloaded activations and state may hold in host memory (--host-budget)
    # --target-batch-size: a trial whose batch (times the ranks) is under it trains with gradient accumulation, so its
    # metered steps are two micro-steps and one optimizer step: the first micro-step's gradients stay resident
    # through the second's forward and backward, as in every accumulated step after the first micro-batch
    target_batch_size: int | None = None


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one trial measured. Times in seconds, memory in bytes; ``None`` where not reached."""

    config: Config
    status: Status  # ok, oom, timeout, failed, or crashed (its worker process died, or CUDA is unusable)
    peak_bytes: int | None = None  # compared to the budget: tracked tensors (CPU) or CUDA reserved; for an
    # oom, what the failing step needed at least (oom_needed_bytes) where known, else what it held
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_nvml_bytes: int | None = None
    host_peak_bytes: int | None = None  # an offloading plan (PLAN+offload): the most its host copies held at once;
    # PLAN+state: plus the state's (sharded parameters, gradients, optimizer state) in host memory
    optimizer_step_share: float | None = None  # PLAN+state: the median timed step's share spent in the optimizer's step
    oom_held_bytes: int | None = None  # oom: bytes held when the failing allocation was made
    oom_needed_bytes: int | None = None  # oom: held plus the allocation that failed
    memory_source: str = ""  # "tensor" or "cuda" (measured), or PREDICTED (a dry run: under fake tensors, not run)
    step_s: float | None = None  # median of the measured steps
    step_times_s: tuple[float, ...] = ()
    samples_per_s: float | None = None
    step_s_spread: float | None = None  # (slowest - fastest) / median of the timed steps, on their different batches
    tokens_per_s: float | None = None  # real tokens (attention_mask, or labels not -100) over the timed steps' time
    time_source: str = ""  # MEASURED (timed steps), PREDICTED (the time model, a dry run), "" (no step time)
    time_model: str | None = None  # a predicted time: the machine that priced it (autotune.timing), e.g. "cpu", "h100-sxm"
    loss_first: float | None = None
    loss_final: float | None = None
    nonfinite_losses: int = 0
    loss_scale_history: tuple[float, ...] = ()  # fp16: the GradScaler's scale after each step
    skipped_steps: int = 0  # fp16: steps the scaler skipped because gradients held inf/NaN
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)  # the checkpoint plan applied (name, blocks)
    error: str | None = None
    wall_s: float = 0.0
    # From asking for the trial to its first step (a worker's start if one started, imports, the model's build and
    # preparation), and from its first step to its end; None where a worker died before it could say
    setup_s: float | None = None
    steps_s: float | None = None
    timed: bool = True  # False: a memory trial, metered and not timed (no step time, no samples/s)
    timings: int = 1  # timed runs whose steps step_times_s holds (a near tie is timed again: 2)
    memory_from: int | None = None  # the memory trial (its Optuna number) whose peaks a later timing completed
    # --parallel: backend, world_size, wrapper, mixed_precision, the rank whose outcome it is, each rank's figures
    distributed: dict[str, Any] | None = None
    # A compiled trial (compile not "none"): seconds its first step took beyond a steady one (dynamo and inductor
    # compiling; counted in setup_s, not steps_s), the graphs dynamo compiled while it ran (0: it reused the
    # process's, compiled by an earlier trial of its variant) and its graph breaks; None for an eager trial
    compile_s: float | None = None
    compiles: int | None = None
    graph_breaks: int | None = None

    @property
    def world_size(self) -> int:
        """Ranks that trained the trial together (1 for a single process): samples/s counts all their micro-batches."""
        return int(self.distributed["world_size"]) if self.distributed else 1

    @property
    def precision(self) -> str:
        return self.config.precision

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))  # "ok" (the JSON's word) is Status.OK

    @property
    def predicted(self) -> bool:
        """Whether the peak was predicted (``--dry-run``: the trial's code under fake tensors), not measured."""
        return self.memory_source == PREDICTED

    @property
    def memory_only(self) -> bool:
        """A memory trial that fit: its peak is known, its speed is not (a timing may complete it)."""
        return self.status is Status.OK and not self.timed

    @property
    def figures(self) -> str:
        """What the trial measured: ``"memory+time"``, ``"memory"`` (a memory trial), or ``"none"`` (failed)."""
        if self.status is not Status.OK:
            return "memory" if self.status is Status.OOM else "none"
        return "memory+time" if self.timed else "memory"

    @property
    def segments(self) -> Plan:
        return self.config.plan

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def fits(self, limit_bytes: float | None) -> bool:
        """True when the trial ran to the end and its peak stays within ``limit_bytes`` (None: no limit)."""
        return self.status is Status.OK and (limit_bytes is None or (self.peak_bytes or 0) <= limit_bytes)

    @property
    def offload(self) -> str:
        """What the trial's plan kept in host memory: ``"activations"`` (``PLAN+offload``), ``"state"`` (``PLAN+state``),
        ``"activations+state"`` or ``"none"``."""
        return str(self.config.plan.offload_mode)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["figures"] = self.figures
        data["offload"] = self.offload
        data["step_times_s"] = list(self.step_times_s)
        data["loss_scale_history"] = list(self.loss_scale_history)
        return _flatten_config(data, floats=("loss_first", "loss_final"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Measurement":
        config, kwargs = _unflatten_config(cls, data, floats=("loss_first", "loss_final"))
        kwargs["step_times_s"] = tuple(kwargs.get("step_times_s", ()))
        kwargs["loss_scale_history"] = tuple(kwargs.get("loss_scale_history", ()))
        return cls(config=config, **kwargs)


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """How many candidates are probed, and on how much data."""

    top: int = 3  # candidates from the Pareto front, fastest first
    epochs: int = 1
    fraction: float = 0.1  # share of the dataset, drawn at random (seeded)
    num_workers: int = 0  # DataLoader worker processes
    max_skipped_share: float = 0.2  # fp16: more skipped steps than this rejects a candidate
    seed: int = 0
    timeout_s: float | None = None  # per candidate pass
    target_batch_size: int | None = None  # the data's worst batch is stepped as trials step it (TrialSettings')

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What one candidate did over the probe's epochs. Memory in bytes, times in seconds."""

    config: Config
    accepted: bool
    reason: str | None = None  # why it was rejected
    steps: int = 0
    samples: int = 0
    peak_bytes_max: int | None = None  # the worst step's peak, the worst batch's included (what the budget is judged by)
    worst_batch_peak_bytes: int | None = None  # the step on the data's worst batch of this size
    peak_bytes_median: int | None = None  # the median step's own peak (allocated on CUDA, reset every step)
    peak_reserved_bytes_max: int | None = None  # CUDA: the caching allocator's reserved peak over the probe
    trial_peak_bytes: int | None = None  # the short trial's peak, for comparison
    host_peak_bytes: int | None = None  # an offloading candidate: the most its host copies held at once, any step
    step_s_median: float | None = None
    step_s_p90: float | None = None
    samples_per_s: float | None = None
    loss_start: float | None = None
    loss_end: float | None = None
    nonfinite_losses: int = 0
    loss_scale: dict[str, float] | None = None  # fp16: initial, final, min, skipped_steps
    grad_norm: dict[str, float] | None = None  # median and max of the global gradient norm
    wall_s: float = 0.0
    distributed: dict[str, Any] | None = None  # --parallel: each rank's verdict, worst peak and samples
    # bf16-true: of up to 1,024 evenly spaced entries of each parameter with a nonzero gradient, over the probe's
    # steps, the share whose update rounded away in bf16 (where fp32 master weights would have moved), and the counts
    lost_updates: dict[str, float] | None = None  # share, lost, sampled

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["grad_norm"]:
            data["grad_norm"] = {k: (v if math.isfinite(v) else str(v)) for k, v in data["grad_norm"].items()}
        return _flatten_config(data, floats=("loss_start", "loss_end"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeResult":
        config, kwargs = _unflatten_config(cls, data, floats=("loss_start", "loss_end"))
        if kwargs.get("grad_norm"):
            kwargs["grad_norm"] = {k: float(v) for k, v in kwargs["grad_norm"].items()}
        return cls(config=config, **kwargs)


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """One plan's step compared with the plan-free step: differences are relative to the value's largest magnitude."""

    plan: Plan
    status: CheckStatus  # exact, within_noise (kept), differs or failed (dropped)
    batch_size: int
    recomputed_blocks: tuple[str, ...] = ()
    max_rel_diff: float | None = None  # the largest relative difference over the loss, gradients and buffers
    max_abs_diff: float | None = None
    worst: str | None = None  # where it is: "loss", "grad:NAME" or "buffer:NAME"
    noise: float = 0.0  # the same measure between two plan-free steps
    tolerance: float = 0.0  # what was allowed: NOISE_MULTIPLE x noise (0: bitwise); compiled: x compile_diff too
    error: str | None = None
    compile: str = EAGER  # the torch.compile mode both steps ran under (compiled against compiled)
    compile_diff: float | None = None  # compiled: the step without a plan against the same step eager (what compile
    # itself changes, the scale a plan's own difference is judged on); for plan 0, the compile check's one figure
    compiles: int | None = None  # compiled: the graphs dynamo compiled for this check's steps (plan 0: the reference
    # and its second run), its batch dimension dynamic as in a trial: the search's fp32 trials of the plan reuse them

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", Plan(self.plan))
        object.__setattr__(self, "status", CheckStatus(self.status))

    @property
    def ok(self) -> bool:
        return self.status.kept

    def describe(self) -> str:
        """One line for the user: what the plan does differently, or that it is exact."""
        under = "" if self.compile == EAGER else f" under torch.compile (mode {self.compile})"
        if self.status is CheckStatus.FAILED:
            return f"checkpoint plan {self.plan}{under}: its check step failed ({self.error})"
        if self.status is CheckStatus.DIFFERS:
            return (f"checkpoint plan {self.plan}{under} trains a different model: {self.worst} differs by "
                    f"{self.max_rel_diff:.3g} (relative; {self.max_abs_diff:.3g} absolute) from the step without a plan, "
                    f"more than the {self.tolerance:.3g} allowed")
        return f"checkpoint plan {self.plan}{under}: {self.status} (largest relative difference {self.max_rel_diff:.3g})"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["plan"], data["status"] = str(self.plan), self.status.value
        data["recomputed_blocks"] = list(self.recomputed_blocks)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanCheck":
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["recomputed_blocks"] = tuple(kwargs.get("recomputed_blocks", ()))
        return cls(**kwargs)


def micro_steps(batch_size: int, target_batch_size: int | None, *, world_size: int = 1) -> int:
    """The micro-steps a metered step runs: 2 where ``batch_size`` (on each of ``world_size`` ranks) accumulates to
    ``target_batch_size`` (every micro-step after the first holds the gradients of those before: the second's memory is
    every later one's), else 1."""
    return 2 if target_batch_size is not None and batch_size * world_size < target_batch_size else 1


def accumulation_plan(micro_batch_size: int, target_batch_size: int | None, *, world_size: int = 1) -> dict[str, Any]:
    """Return gradient-accumulation steps so that micro x steps (x ranks) reaches ``target_batch_size``.

    ``micro_batch_size`` is per rank; with ``world_size`` ranks each optimizer step sees
    ``micro x world_size x steps`` samples.
    """
    per_step = micro_batch_size * world_size
    ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
    base = {"world_size": world_size} if world_size > 1 else {}
    if target_batch_size is None:
        return {"target_batch_size": None, "micro_batch_size": micro_batch_size, **base, "accumulation_steps": 1,
                "effective_batch_size": per_step, "lr_note": None}
    if target_batch_size < 1:
        raise UsageError(f"--target-batch-size {target_batch_size} must be at least 1")
    steps = max(1, math.ceil(target_batch_size / per_step))
    effective = per_step * steps
    if effective == target_batch_size:
        note = (f"keep the learning rate you tuned for batch {target_batch_size}: {steps} micro-batches of "
                f"{micro_batch_size}{ranks} make one optimizer step of exactly that batch")
    else:
        note = (f"the effective batch is {effective}, not {target_batch_size}: keep the learning rate of batch "
                f"{target_batch_size} scaled linearly by {effective}/{target_batch_size} = "
                f"{effective / target_batch_size:.3f}, or train with micro-batches of "
                f"{math.ceil(target_batch_size / (steps * world_size))}{ranks} to hit the target")
    if per_step > target_batch_size:
        batch = "a global batch of" if world_size > 1 else "batch"
        note = (f"the recommended micro-batch ({micro_batch_size}{ranks}) is larger than the target: train with "
                f"{batch} {target_batch_size} at your tuned learning rate, or with {batch} {per_step} and the learning "
                f"rate scaled linearly by {per_step / target_batch_size:.3f}")
        steps, effective = 1, per_step
    return {"target_batch_size": target_batch_size, "micro_batch_size": micro_batch_size, **base,
            "accumulation_steps": steps, "effective_batch_size": effective, "lr_note": note}


def _flatten_config(data: dict[str, Any], *, floats: tuple[str, ...]) -> dict[str, Any]:
    """A dataclass dict with its ``config`` spread into the top level, JSON-safe.

    Strict JSON has no NaN or inf: the ``floats`` fields keep them as text ("nan", "inf").
    """
    config = data.pop("config")
    config = {"precision": config["precision"], "segments": str(config["plan"]), "batch_size": config["batch_size"],
              "compile": config["compile"]}
    for key in floats:
        if data.get(key) is not None and not math.isfinite(data[key]):
            data[key] = str(data[key])
    return {**config, **data}


def _unflatten_config(cls: type, data: dict[str, Any], *, floats: tuple[str, ...]) -> tuple[Config, dict[str, Any]]:
    """The inverse of :func:`_flatten_config`: the Config and the keyword arguments ``cls`` knows."""
    data = dict(data)
    config = Config(data.pop("precision"), Plan(data.pop("segments")), int(data.pop("batch_size")),
                    data.pop("compile", None) or EAGER)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in fields}
    for key in floats:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = float(kwargs[key])
    return config, kwargs

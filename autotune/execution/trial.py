"""One real, short training run of one configuration: its peak memory, step time and outcome.

:func:`run_trial` runs it in this process; :class:`TrialWork` is the same trial as a piece of work
that any venue runs (:mod:`autotune.execution.venue`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch

from autotune._log import logger
from autotune.device import backend_for
from autotune.errors import TrialTimeoutError, UsageError
from autotune.execution.agreement import combine
from autotune.execution.work import Place, Work, outcome
from autotune.meters import Meter
from autotune.records import Config, Measurement, TrialSettings, micro_steps, settled, timing_fields
from autotune.training.compiled import CompileCount, compile_failure, compiling
from autotune.training.data import real_tokens
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload, to_device
from autotune.vocabulary import Status

if TYPE_CHECKING:
    from autotune.training.wrapping import Wrapping

__all__ = ["TrialWork", "TrialRun", "TrialRecord", "run_trial"]

_STATE_STEPS = 8  # an optimizer that could not be primed: steps until it holds state (fp16's skipped steps make none)


class TrialRun(Trainer):
    """A trial: the trainer, its worst batch (memory) and its random batches (timed steps); a prediction
    (:mod:`autotune.execution.predict`) runs one under fake tensors."""

    def __init__(self, workload: Workload, config: Config, device: torch.device, settings: TrialSettings,
                 parallel: "Wrapping | None" = None, *, host_apart: bool | None = None) -> None:
        super().__init__(workload, config, device, lr=settings.lr, seed=settings.seed, guard=settings.guard,
                         parallel=parallel, host_budget_bytes=settings.host_budget_bytes, host_apart=host_apart)
        self.settings = settings
        self.step_times: list[float] = []
        self.tokens: list[int | None] = []  # real tokens of each timed step's batch
        self.first_step_at: float | None = None  # time.time() when the model was ready and its first step began
        self.warmup_times: list[float] = []  # each warm-up step's wall seconds (a compiled trial's first compiles)
        # the metered steps' micro-steps: 2 where the batch accumulates to --target-batch-size (timed steps take one)
        self.micro_steps = micro_steps(config.batch_size, settings.target_batch_size,
                                       world_size=parallel.job.world_size if parallel is not None else 1)

    def build(self) -> None:
        super().build()
        self.batch = self.memory_batch()

    def memory_batch(self) -> Any:
        """The batch the memory is measured on: the data's worst of the size, or ``example_batch``, on the device."""
        return to_device(self.workload.make_batch(self.module, self.config.batch_size), self.device)

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
                slowest = self.parallel.slowest(seconds, deadline is not None and time.monotonic() + seconds > deadline)
                seconds, late = slowest.seconds, slowest.late
            self.step_times.append(seconds)
            self._log_step("timed", self.step_times[-1])

    def warm_up(self, steps: int, kind: str) -> None:
        """``steps`` steps on the worst batch, each one's wall seconds kept (a compiled trial's first compiles)."""
        for _ in range(steps):
            began = time.monotonic()
            self.step(self.batch, micro_steps=self.micro_steps)
            self.warmup_times.append(time.monotonic() - began)
            self._log_step(kind)

    def make_state(self) -> None:
        """For an optimizer that could not be primed: step until it holds state, then once more with it held."""
        for _ in range(_STATE_STEPS):
            if self.holds_state:
                break
            self.step(self.batch)
        self.step(self.batch, micro_steps=self.micro_steps)
        self._log_step("warm-up (the optimizer's state made)")

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
    asked_at: float | None = None,
) -> Measurement:
    """Train ``config`` for a few steps on a fresh model and optimizer; return what was measured.

    ``timed=False`` makes a memory trial: the metered steps only, no timed steps (no samples/s).
    ``metered=False`` (for a meter that slows steps, the tensor meter) times without the meter: the
    timing that completes an earlier memory trial of the configuration (:func:`records.completed`).
    ``parallel`` (:mod:`autotune.execution.ranks`) trains this rank's part of a distributed trial.
    ``asked_at`` (``time.time()``, in any process of this machine) is when the trial was asked for: its
    ``setup_s`` runs from then to its first step (a worker's start included), else from this call.
    Out-of-memory, time-outs, a crashed device and errors in the user's model are outcomes (status
    ``oom``, ``timeout``, ``crashed``, ``failed``), not exceptions; bad input (:class:`UsageError`)
    and ``KeyboardInterrupt`` propagate. Memory is released before returning.
    """
    device = torch.device(device)
    _check_meter(config, meter, metered)
    asked_at = time.time() if asked_at is None else asked_at
    started = time.monotonic()
    deadline = started + settings.timeout_s if settings.timeout_s else None
    run = TrialRun(workload, config, device, settings, parallel)
    status, error, handle = Status.OK, None, None
    count = CompileCount(config.variant).start() if config.compiled else None
    timed_inside = timed and metered and not meter.slows_steps  # a meter that costs nothing times in its region
    workload.warm(settings.seed)  # the model built once per process, outside the meter: trials start from copies
    try:
        with compiling() if config.compiled else contextlib.nullcontext():
            with meter.measure(deadline=deadline) if metered else contextlib.nullcontext() as handle:
                run.build()
                run.first_step_at = time.time()
                run.warm_up(_warmup_steps(meter, settings, config),
                            "warm-up (metered)" if metered and meter.slows_steps else "warm-up")
                if run.unprimed is not None:  # no ballast: step until the optimizer holds state, then once with it
                    run.make_state()
                if timed_inside:
                    run.timed_steps(deadline)
            if timed and not timed_inside:
                run.timed_steps(deadline)
    except Exception as exc:  # noqa: BLE001 - every failure of the user's code is an outcome
        failure = outcome(compile_failure(exc) or exc)
        status, error = failure.status, failure.error
    finally:
        record = TrialRecord.of(run, asked_at, count)
        run.release()
        del run  # model, optimizer, batch and activations go with it
        backend_for(device).release()
    return record.measurement(config, status, error, handle.reading if handle is not None else None, started, timed)


def _check_meter(config: Config, meter: Meter, metered: bool) -> None:
    """Refuse to meter a compiled trial with a meter that cannot see compiled code: it would measure eager training."""
    if config.compiled and metered and not meter.sees_compiled:
        raise UsageError(f"{type(meter).__name__} cannot measure compiled training (dynamo runs the step eager under "
                         f"it): measure {config} with the device's meter for compiled trials "
                         f"(autotune.device.backend_for(device).meter(budget, compiled=True))")


def _warmup_steps(meter: Meter, settings: TrialSettings, config: Config) -> int:
    """The warm-up steps: one where the meter slows every op (the optimizer's state primed, one step holds all a step
    holds; the timed steps run after it without the meter); compiled, two at least (the first compiles, the second
    shows what a steady step takes)."""
    steps = 1 if meter.slows_steps else settings.warmup_steps
    return max(steps, 2) if config.compiled else steps


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """What a trial's run kept, beside the meter's reading: made by a trial (:meth:`of`) and by a prediction alike
    (which steps once, untimed: its defaults), and turned into the trial's :class:`Measurement`."""

    plan: Any = None  # the checkpoint plan as applied (its blocks), or None
    losses: tuple[float, ...] = ()  # every step's loss, the metered ones first
    loss_scales: tuple[float, ...] = ()  # the GradScaler's scale after each step (fp16)
    skipped_steps: int = 0  # steps the GradScaler skipped (inf/NaN gradients)
    step_times_s: tuple[float, ...] = ()  # each timed step's wall seconds
    tokens: tuple[int | None, ...] = ()  # the real tokens of each timed step's batch (None: not a token batch)
    setup_s: float = 0.0  # from the ask to the first step: a worker's start, imports, the model's build
    steps_s: float = 0.0  # from the first step to the end
    host_peak_bytes: int | None = None  # what offloaded plans held in host memory
    optimizer_step_share: float | None = None  # the optimizer step's share of a step, its state in host memory
    compile_s: float | None = None  # a compiled trial's compile seconds (its first step beyond its second)
    compiles: int | None = None  # graphs compiled
    graph_breaks: int | None = None

    @classmethod
    def of(cls, run: TrialRun, asked_at: float, count: CompileCount | None) -> "TrialRecord":
        """What ``run`` kept, its set-up counted from ``asked_at`` (``time.time()``), ``count`` its compiles."""
        setup_s, steps_s = _setup_and_steps(asked_at, run.first_step_at)
        compile_s = compiles = breaks = None
        if count is not None:
            warm = run.warmup_times
            compile_s = round(max(0.0, warm[0] - warm[1]), 4) if len(warm) >= 2 else None
            compiles, breaks = count.graphs, count.breaks
        if compile_s is not None:  # compiling is set-up: the steps are what training repeats
            setup_s, steps_s = round(setup_s + compile_s, 4), round(max(0.0, steps_s - compile_s), 4)
        return cls(plan=run.plan, losses=tuple(run.losses), loss_scales=tuple(run.scales), skipped_steps=run.skipped,
                   step_times_s=tuple(run.step_times), tokens=tuple(run.tokens), setup_s=setup_s, steps_s=steps_s,
                   host_peak_bytes=run.host_peak_bytes,
                   optimizer_step_share=(run.host_state.step_share(run.step_times) if run.host_state is not None
                                         else None),
                   compile_s=compile_s, compiles=compiles, graph_breaks=breaks)

    def measurement(self, config: Config, status: str, error: str | None, reading: Any, started: float,
                    timed: bool) -> Measurement:
        """The trial's :class:`Measurement` from this record and the meter's ``reading`` (None: none was taken)."""
        ok = status == Status.OK
        real = sum(self.tokens) if self.tokens and None not in self.tokens else None
        losses = self.losses
        return Measurement(
            config=config,
            status=status,
            peak_bytes=reading.peak_bytes if reading else None,
            peak_allocated_bytes=reading.peak_allocated_bytes if reading else None,
            peak_reserved_bytes=reading.peak_reserved_bytes if reading else None,
            peak_nvml_bytes=reading.peak_nvml_bytes if reading else None,
            host_peak_bytes=self.host_peak_bytes,
            optimizer_step_share=self.optimizer_step_share,
            oom_held_bytes=getattr(reading, "oom_held_bytes", None),
            oom_needed_bytes=getattr(reading, "oom_needed_bytes", None),
            memory_source=reading.source if reading else "",
            **timing_fields(config.batch_size, self.step_times_s, real, ok),
            loss_first=losses[0] if losses else None,
            loss_final=losses[-1] if losses else None,
            nonfinite_losses=sum(not math.isfinite(v) for v in losses),
            loss_scale_history=self.loss_scales,
            skipped_steps=self.skipped_steps,
            plan=self.plan,
            error=error,
            wall_s=time.monotonic() - started,
            setup_s=self.setup_s,
            steps_s=self.steps_s,
            timed=timed,
            compile_s=self.compile_s,
            compiles=self.compiles,
            graph_breaks=self.graph_breaks,
        )


def _setup_and_steps(asked_at: float, first_step_at: float | None) -> tuple[float, float]:
    """Seconds from the ask to the first step, and from it to now (a trial that never stepped: all set-up)."""
    now = time.time()
    first = now if first_step_at is None else first_step_at
    return round(max(0.0, first - asked_at), 4), round(now - first, 4)


@dataclasses.dataclass(frozen=True)
class TrialWork(Work):
    """A trial as a piece of work: ``config`` trained under ``enforced_bytes`` (see :func:`run_trial`)."""

    config: Config
    settings: TrialSettings
    enforced_bytes: int | None  # the budget the trial runs under (each rank's own share in a --parallel job)
    timed: bool = True
    metered: bool = True
    asked_at: float | None = None  # time.time() when the search asked for it: set-up counts from here

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"autotune-trial-{self.config.precision}-{self.config.plan}-b{self.config.batch_size}"

    @property
    def timeout_s(self) -> float | None:
        return self.settings.timeout_s

    def run(self, workload: Workload, place: Place) -> Measurement:
        return run_trial(workload, self.config, device=place.device,
                         meter=place.meter_for(self.enforced_bytes, compiled=self.config.compiled),
                         settings=self.settings, timed=self.timed, metered=self.metered, parallel=place.parallel,
                         asked_at=self.asked_at)

    def failed(self, status: str, error: str, seconds: float) -> Measurement:
        if status == Status.CRASHED:
            error = f"the trial's {error}"  # "the trial's worker process killed by SIGKILL"
        return Measurement(config=self.config, status=status, wall_s=seconds, error=error, timed=self.timed)

    def agree(self, parts: list[Any], job: Any) -> Any:
        return combine(parts, job)

    def left_early(self, result: Measurement) -> bool:
        return result.status != Status.OK

    def decode(self, data: dict) -> Measurement:
        return Measurement.from_dict(data)

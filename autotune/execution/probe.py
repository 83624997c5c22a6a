"""The probing phase: the best candidates train real epochs over a slice of the user's data.

Short trials measure memory on the worst batch the data can make and time a few random batches.
Real training also meets AMP overflows that appear after some steps and losses that go NaN. So
the top candidates of the Pareto front each train ``epochs`` epochs over a random ``fraction`` of
the dataset through a real ``DataLoader`` (the user's ``collate_fn``) and then one step on the
data's worst batch of their size, and the recommendation is taken from what they did
there: the fastest candidate that was not rejected, judged by its worst-case peak.

A candidate is rejected when it runs out of memory, produces a non-finite loss, skips more than
``max_skipped_share`` of its steps (fp16 overflow), its loss scale collapses below 1, or its
worst-case peak leaves less headroom than the budget asks for. A bf16-true candidate also counts the
updates bf16 rounded away (``lost_updates``: of a fixed sample of each parameter's entries with a
nonzero gradient, those its step left unchanged, where fp32 master weights would have moved): said,
not a rejection, as the user chose bf16's resolution by naming it. Where the meter slows steps (the
CPU tensor meter) each candidate trains twice on the same batches: once metered, for memory and
stability, and once timed.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch.utils.data import DataLoader, Subset

from autotune.device import backend_for
from autotune.errors import TrialTimeoutError, UsageError
from autotune.meters import Meter
from autotune.records import GuardRails, Measurement, ProbeResult, ProbeSettings, micro_steps, usable_bytes
from autotune.units import quantile
from autotune.vocabulary import INIT_LOSS_SCALE, Status
from autotune.execution.agreement import combine_probe, probe_left_early
from autotune.execution.work import Place, Work, outcome
from autotune.training.compiled import compile_failure, compiling
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload, to_device

if TYPE_CHECKING:
    from autotune.training.wrapping import Wrapping

__all__ = ["run_probe", "ProbeWork"]

MIN_LOSS_SCALE = 1.0  # below this, fp16 gradients overflow even unscaled: the scaler has collapsed


def _loader(workload: Workload, batch_size: int, settings: ProbeSettings, rank: int = 0, world_size: int = 1) -> DataLoader:
    """The slice's batches; with ``world_size`` ranks, this rank's equal share of the slice (as a DistributedSampler
    without padding: every rank steps as often as the others)."""
    dataset = workload.dataset
    n = len(dataset)
    size = math.ceil(settings.fraction * n)
    g = torch.Generator().manual_seed(settings.seed)
    indices = torch.randperm(n, generator=g)[:size].tolist()
    if world_size > 1:
        indices = indices[rank::world_size][:len(indices) // world_size]
    # The subset is already in random order: every candidate sees the same batches.
    return DataLoader(Subset(dataset, indices), batch_size=batch_size, shuffle=False,
                      num_workers=settings.num_workers, collate_fn=workload.collate_fn)


def _batch_len(batch: Any) -> int:
    first = next((t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1


class _Candidate:
    """One candidate's probe: its trainer, what every step took and peaked at, and why it was rejected."""

    def __init__(self, workload: Workload, trial: Measurement, device: torch.device, settings: ProbeSettings,
                 guard: GuardRails, lr: float, budget_bytes: int | None, parallel: "Wrapping | None" = None,
                 host_budget_bytes: int | None = None) -> None:
        self.workload, self.trial, self.config, self.device = workload, trial, trial.config, device
        self.budget_bytes = budget_bytes
        self.settings, self.guard, self.lr, self.parallel = settings, guard, lr, parallel
        rank, world = (parallel.job.rank, parallel.job.world_size) if parallel else (0, 1)
        self.loader = _loader(workload, self.config.batch_size, settings, rank, world)
        self.trainer = Trainer(workload, self.config, device, lr=lr, seed=settings.seed, guard=guard,
                               record_grad_norm=True, parallel=parallel, host_budget_bytes=host_budget_bytes)
        self.step_peaks: list[int] = []  # each step's own peak: allocated on CUDA, reset every step
        self.reserved: list[int] = []  # CUDA: the caching allocator's reserved peak of each step
        self.step_times: list[float] = []
        self.samples = 0
        self.worst_peak: int | None = None
        self.host_peak_bytes: int | None = None  # read before the trainer lets its model go
        self.reason: str | None = None

    def train(self, meter: Meter, deadline: float | None) -> None:
        """The epochs, then the data's worst batch of this size with the optimizer's state: metered step by step."""
        with meter.measure(deadline=deadline) as handle:
            self.handle = handle
            self.trainer.build()
            for batch in _epochs(self.loader, self.settings.epochs, self.device, deadline):
                self._metered(lambda b=batch: self.step_times.append(self._timed(self.trainer, b)))
                self.samples += _batch_len(batch)
            worst = to_device(self.workload.make_batch(self.trainer.module, self.config.batch_size), self.device)
            # accumulating to --target-batch-size: two micro-steps of it, the first's gradients resident (as a trial)
            accumulated = micro_steps(self.config.batch_size, self.settings.target_batch_size,
                                      world_size=self.parallel.job.world_size if self.parallel is not None else 1)
            self._metered(lambda: self.trainer.step(worst, micro_steps=accumulated))
            self.worst_peak = self.step_peaks[-1]
        if meter.slows_steps:  # time the same batches again, unmetered, on a fresh model
            timer = Trainer(self.workload, self.config, self.device, lr=self.lr, seed=self.settings.seed, guard=self.guard,
                            parallel=self.parallel)
            timer.build()
            self.step_times = [self._timed(timer, b)
                               for b in _epochs(self.loader, self.settings.epochs, self.device, deadline)]
            timer.release()

    def _timed(self, trainer: Trainer, batch: Any) -> float:
        """A timed step; with ``--parallel`` the slowest rank's time of it (every rank keeps the same)."""
        seconds = trainer.timed_step(batch)
        return self.parallel.slowest(seconds, False).seconds if self.parallel is not None else seconds

    def _metered(self, step: Any) -> None:
        self.handle.reset_peak()
        step()
        self.step_peaks.append(self.handle.peak_bytes())
        reserved = self.handle.peak_reserved_bytes()
        if reserved is not None:
            self.reserved.append(reserved)

    def failed(self, exc: Exception) -> None:
        """Record why the candidate stopped (re-raises bad input)."""
        failure = outcome(exc)
        self.reason = f"{failure.status}: {failure.error}"
        reading = getattr(getattr(self, "handle", None), "reading", None)
        if failure.status == Status.OOM:  # what the failing step needed: above the budget, as a trial's oom peak is
            self.step_peaks.append(reading.peak_bytes if reading else self.budget_bytes or 0)

    def verdict(self, headroom: float) -> None:
        """Reject a candidate that went non-finite, whose fp16 scaler collapsed or skipped, or left too little headroom."""
        losses, trainer = self.trainer.losses, self.trainer
        nonfinite = sum(not math.isfinite(v) for v in losses)
        limit = usable_bytes(self.budget_bytes, headroom)
        peak_max = self.peak_max()
        if self.reason is not None:
            return
        if nonfinite:
            self.reason = f"non-finite loss in {nonfinite} of {len(losses)} steps"
        elif trainer.scales and min(trainer.scales) < MIN_LOSS_SCALE:
            self.reason = f"the fp16 loss scale collapsed to {min(trainer.scales):g}: gradients overflow even unscaled"
        elif trainer.scales and trainer.skipped > self.settings.max_skipped_share * len(losses):
            self.reason = f"the GradScaler skipped {trainer.skipped} of {len(losses)} steps (inf/NaN gradients)"
        elif limit is not None and peak_max is not None and peak_max > limit:
            self.reason = (f"worst-case peak {peak_max} bytes leaves less than {headroom:.0%} headroom "
                           f"(the short trial peaked at {self.trial.peak_bytes})")

    def peak_max(self) -> int | None:
        """The worst step's peak as the budget counts it: reserved on CUDA (what the allocator holds), else tracked."""
        return max(self.step_peaks + self.reserved) if self.step_peaks else None

    def result(self, started: float) -> ProbeResult:
        trainer, reason = self.trainer, self.reason
        losses, scales = trainer.losses, trainer.scales
        epoch = losses[:-1] if self.worst_peak is not None else losses  # without the worst batch's step
        finite_norms = [v for v in trainer.grad_norms if math.isfinite(v)]
        return ProbeResult(
            config=self.config,
            accepted=reason is None,
            reason=reason,
            steps=len(epoch),
            samples=self.samples,
            peak_bytes_max=self.peak_max(),
            worst_batch_peak_bytes=self.worst_peak,
            peak_bytes_median=int(statistics.median(self.step_peaks)) if self.step_peaks else None,
            peak_reserved_bytes_max=max(self.reserved) if self.reserved else None,
            trial_peak_bytes=self.trial.peak_bytes,
            host_peak_bytes=self.host_peak_bytes,
            step_s_median=statistics.median(self.step_times) if self.step_times else None,
            step_s_p90=quantile(self.step_times, 0.9),
            samples_per_s=self.samples / sum(self.step_times) if self.step_times and reason is None else None,
            loss_start=epoch[0] if epoch else None,
            loss_end=epoch[-1] if epoch else None,
            nonfinite_losses=sum(not math.isfinite(v) for v in losses),
            loss_scale=({"initial": INIT_LOSS_SCALE, "final": scales[-1], "min": min(scales),
                         "skipped_steps": trainer.skipped} if scales else None),
            grad_norm={"median": statistics.median(finite_norms), "max": max(finite_norms)} if finite_norms else None,
            wall_s=time.monotonic() - started,
            lost_updates=trainer.lost_updates,
        )


def run_probe(
    workload: Workload,
    trial: Measurement,
    *,
    device: torch.device,
    meter: Meter | None = None,
    budget_bytes: int | None,
    headroom: float,
    settings: ProbeSettings = ProbeSettings(),
    guard: GuardRails = GuardRails(),
    lr: float = 1e-4,
    parallel: "Wrapping | None" = None,
    host_budget_bytes: int | None = None,
) -> ProbeResult:
    """Train ``trial``'s configuration over the probe's epochs in this process; return what happened.

    ``meter`` defaults to the device's, enforcing ``budget_bytes``. ``parallel``
    (:mod:`autotune.execution.ranks`) makes this rank's part of a distributed probe: its share of the
    slice, under the job's wrapper. An offloading candidate's host copies may hold ``host_budget_bytes`` at most (the
    search's host budget: past it, a step is the host's out-of-memory error and rejects the candidate).
    """
    if workload.dataset is None:
        raise UsageError("the probe trains on --data: pass a dataset, or --no-probe")
    device = torch.device(device)
    backend = backend_for(device)
    compiled = trial.config.compiled
    meter = meter if meter is not None else backend.meter(budget_bytes, compiled=compiled)
    started = time.monotonic()
    deadline = started + settings.timeout_s if settings.timeout_s else None
    candidate = _Candidate(workload, trial, device, settings, guard, lr, budget_bytes, parallel, host_budget_bytes)
    try:
        with compiling() if compiled else contextlib.nullcontext():
            candidate.train(meter, deadline)
    except Exception as exc:  # noqa: BLE001 - the candidate's outcome
        candidate.failed(compile_failure(exc) or exc)
    finally:
        candidate.host_peak_bytes = candidate.trainer.host_peak_bytes
        candidate.trainer.release()
        backend.release()
    candidate.verdict(headroom)
    return candidate.result(started)


def _epochs(loader: DataLoader, epochs: int, device: torch.device, deadline: float | None) -> Iterator[Any]:
    """The loader's batches, on the device, ``epochs`` times over; stops at the deadline."""
    for _ in range(epochs):
        for batch in loader:
            if deadline is not None and time.monotonic() > deadline:
                raise TrialTimeoutError("the probe ran past its time limit (--trial-timeout)")
            yield to_device(batch, device)


@dataclasses.dataclass(frozen=True)
class ProbeWork(Work):
    """One candidate's probe as a piece of work (see :func:`run_probe`); with ``--parallel`` each rank trains its
    share of the slice under the job's wrapper. In a worker, a crash or a sticky CUDA error rejects the candidate."""

    trial: Measurement
    budget_bytes: int | None  # the recommendation's budget, which the worst-case peak is judged against
    headroom: float
    settings: ProbeSettings
    guard: GuardRails
    passes: int = 1  # 2 where the meter slows steps (the candidate trains metered, then timed)
    host_budget_bytes: int | None = None  # what an offloading candidate may hold in host memory (the search's)

    @property
    def name(self) -> str:  # type: ignore[override]
        c = self.trial.config
        return f"autotune-probe-{c.precision}-{c.plan}-b{c.batch_size}"

    @property
    def timeout_s(self) -> float | None:
        return self.settings.timeout_s * self.passes if self.settings.timeout_s else None

    def run(self, workload: Workload, place: Place) -> ProbeResult:
        budget = place.budget(self.budget_bytes)
        return run_probe(workload, self.trial, device=place.device,
                         meter=place.meter_for(self.budget_bytes, compiled=self.trial.config.compiled),
                         budget_bytes=budget, headroom=self.headroom, settings=self.settings, guard=self.guard,
                         parallel=place.parallel, host_budget_bytes=self.host_budget_bytes)

    def failed(self, status: str, error: str, seconds: float) -> ProbeResult:
        return ProbeResult(config=self.trial.config, accepted=False, reason=f"{status}: the probe's {error}",
                           trial_peak_bytes=self.trial.peak_bytes, wall_s=seconds)

    def agree(self, parts: list[Any], job: Any) -> Any:
        return combine_probe(parts, job)

    def left_early(self, result: ProbeResult) -> bool:
        return probe_left_early(result)

    def decode(self, data: dict) -> ProbeResult:
        return ProbeResult.from_dict(data)

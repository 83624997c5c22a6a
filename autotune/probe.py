"""The probing phase: the best candidates train real epochs over a slice of the user's data.

Short trials measure memory on the worst batch the data can make and time a few random batches.
Real training also meets AMP overflows that appear after some steps and losses that go NaN. So
the top candidates of the Pareto front each train ``epochs`` epochs over a random ``fraction`` of
the dataset through a real ``DataLoader`` (the user's ``collate_fn``) and then one step on the
data's worst batch of their size, and the recommendation is taken from what they did
there: the fastest candidate that was not rejected, judged by its worst-case peak.

A candidate is rejected when it runs out of memory, produces a non-finite loss, skips more than
``max_skipped_share`` of its steps (fp16 overflow), its loss scale collapses below 1, or its
worst-case peak leaves less headroom than the budget asks for. Where the meter slows steps (the
CPU tensor meter) each candidate trains twice on the same batches: once metered, for memory and
stability, and once timed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Subset

from autotune.errors import TrialTimeoutError, UsageError, first_line, is_oom
from autotune.meters import Meter
from autotune.precision import INIT_LOSS_SCALE
from autotune.space import Config
from autotune.trial import GuardRails, Measurement, Trainer, flatten_config, release_memory, unflatten_config
from autotune.workload import Workload, to_device

__all__ = ["ProbeSettings", "ProbeResult", "probe_candidates", "run_probe", "choose"]

MIN_LOSS_SCALE = 1.0  # below this, fp16 gradients overflow even unscaled: the scaler has collapsed


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
    peak_bytes_median: int | None = None
    trial_peak_bytes: int | None = None  # the short trial's peak, for comparison
    step_s_median: float | None = None
    step_s_p90: float | None = None
    samples_per_s: float | None = None
    loss_start: float | None = None
    loss_end: float | None = None
    nonfinite_losses: int = 0
    loss_scale: dict[str, float] | None = None  # fp16: initial, final, min, skipped_steps
    grad_norm: dict[str, float] | None = None  # median and max of the global gradient norm
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data["grad_norm"]:
            data["grad_norm"] = {k: (v if math.isfinite(v) else str(v)) for k, v in data["grad_norm"].items()}
        return flatten_config(data, floats=("loss_start", "loss_end"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeResult":
        config, kwargs = unflatten_config(cls, data, floats=("loss_start", "loss_end"))
        if kwargs.get("grad_norm"):
            kwargs["grad_norm"] = {k: float(v) for k, v in kwargs["grad_norm"].items()}
        return cls(config=config, **kwargs)


def probe_candidates(pareto: Iterable[Measurement], budget_bytes: int | None, headroom: float, top: int) -> list[Measurement]:
    """Return up to ``top`` front trials within ``budget x (1 - headroom)``, fastest first."""
    limit = None if budget_bytes is None else budget_bytes * (1.0 - headroom)
    fitting = [m for m in pareto if limit is None or m.peak_bytes <= limit]
    return sorted(fitting, key=lambda m: (-m.samples_per_s, m.peak_bytes))[:top]


def _loader(workload: Workload, batch_size: int, settings: ProbeSettings) -> DataLoader:
    dataset = workload.dataset
    n = len(dataset)
    size = math.ceil(settings.fraction * n)
    g = torch.Generator().manual_seed(settings.seed)
    indices = torch.randperm(n, generator=g)[:size].tolist()
    # The subset is already in random order: every candidate sees the same batches.
    return DataLoader(Subset(dataset, indices), batch_size=batch_size, shuffle=False,
                      num_workers=settings.num_workers, collate_fn=workload.collate_fn)


def _batch_len(batch: Any) -> int:
    first = next((t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1


def run_probe(
    workload: Workload,
    trial: Measurement,
    *,
    device: torch.device,
    meter: Meter,
    budget_bytes: int | None,
    headroom: float,
    settings: ProbeSettings = ProbeSettings(),
    guard: GuardRails = GuardRails(),
    lr: float = 1e-4,
) -> ProbeResult:
    """Train ``trial``'s configuration over the probe's epochs; return what happened."""
    if workload.dataset is None:
        raise UsageError("the probe trains on --data: pass a dataset, or --no-probe")
    config = trial.config
    loader = _loader(workload, config.batch_size, settings)
    started = time.monotonic()
    deadline = started + settings.timeout_s if settings.timeout_s else None
    trainer = Trainer(workload, config, device, lr=lr, seed=settings.seed, guard=guard, record_grad_norm=True)
    step_peaks: list[int] = []
    step_times: list[float] = []
    samples = 0
    worst_peak = None
    reason = None
    try:
        with meter.measure(deadline=deadline) as handle:
            trainer.build()
            for batch in _epochs(loader, settings.epochs, device, deadline):
                handle.reset_peak()
                step_times.append(trainer.timed_step(batch))
                step_peaks.append(handle.peak_bytes())
                samples += _batch_len(batch)
            # Then the worst batch the data can make at this size (its largest items), with the optimizer's state.
            handle.reset_peak()
            trainer.step(to_device(workload.make_batch(trainer.model, config.batch_size), device))
            worst_peak = handle.peak_bytes()
            step_peaks.append(worst_peak)
        if meter.slows_steps:  # time the same batches again, unmetered, on a fresh model
            timer = Trainer(workload, config, device, lr=lr, seed=settings.seed, guard=guard)
            timer.build()
            step_times = [timer.timed_step(batch) for batch in _epochs(loader, settings.epochs, device, deadline)]
            timer.release()
    except UsageError:
        raise
    except TrialTimeoutError as exc:
        reason = f"timeout: {exc}"
    except Exception as exc:  # noqa: BLE001 - the candidate's outcome
        reason = f"oom: {first_line(exc)}" if is_oom(exc) else f"failed: {type(exc).__name__}: {first_line(exc)}"
        if is_oom(exc):
            step_peaks.append(handle.reading.peak_bytes if handle.reading else budget_bytes or 0)
    finally:
        trainer.release()
        release_memory(device)

    losses, scales = trainer.losses, trainer.scales
    epoch = losses[:-1] if worst_peak is not None else losses  # the epoch's losses, without the worst batch's step
    nonfinite = sum(not math.isfinite(v) for v in losses)
    peak_max = max(step_peaks) if step_peaks else None
    loss_scale = None
    if trainer.mode.uses_scaler and scales:
        loss_scale = {"initial": INIT_LOSS_SCALE, "final": scales[-1], "min": min(scales),
                      "skipped_steps": trainer.skipped}
    if reason is None:
        limit = None if budget_bytes is None else budget_bytes * (1.0 - headroom)
        if nonfinite:
            reason = f"non-finite loss in {nonfinite} of {len(losses)} steps"
        elif loss_scale and loss_scale["min"] < MIN_LOSS_SCALE:
            reason = f"the fp16 loss scale collapsed to {loss_scale['min']:g}: gradients overflow even unscaled"
        elif loss_scale and trainer.skipped > settings.max_skipped_share * len(losses):
            reason = f"the GradScaler skipped {trainer.skipped} of {len(losses)} steps (inf/NaN gradients)"
        elif limit is not None and peak_max is not None and peak_max > limit:
            reason = (f"worst-case peak {peak_max} bytes leaves less than {headroom:.0%} headroom "
                      f"(the short trial peaked at {trial.peak_bytes})")
    finite_norms = [v for v in trainer.grad_norms if math.isfinite(v)]
    step_median = statistics.median(step_times) if step_times else None
    return ProbeResult(
        config=config,
        accepted=reason is None,
        reason=reason,
        steps=len(epoch),
        samples=samples,
        peak_bytes_max=peak_max,
        worst_batch_peak_bytes=worst_peak,
        peak_bytes_median=int(statistics.median(step_peaks)) if step_peaks else None,
        trial_peak_bytes=trial.peak_bytes,
        step_s_median=step_median,
        step_s_p90=_quantile(step_times, 0.9),
        samples_per_s=samples / sum(step_times) if step_times and reason is None else None,
        loss_start=epoch[0] if epoch else None,
        loss_end=epoch[-1] if epoch else None,
        nonfinite_losses=nonfinite,
        loss_scale=loss_scale,
        grad_norm={"median": statistics.median(finite_norms), "max": max(finite_norms)} if finite_norms else None,
        wall_s=time.monotonic() - started,
    )


def _epochs(loader: DataLoader, epochs: int, device: torch.device, deadline: float | None) -> Iterator[Any]:
    """The loader's batches, on the device, ``epochs`` times over; stops at the deadline."""
    for _ in range(epochs):
        for batch in loader:
            if deadline is not None and time.monotonic() > deadline:
                raise TrialTimeoutError("the probe ran past its time limit (--trial-timeout)")
            yield to_device(batch, device)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def choose(results: Iterable[ProbeResult]) -> ProbeResult | None:
    """Return the fastest accepted candidate, or None when every one was rejected."""
    accepted = [r for r in results if r.accepted and r.samples_per_s]
    return max(accepted, key=lambda r: (r.samples_per_s, -(r.peak_bytes_max or 0)), default=None)

"""The space predicted before a search: each variant's limit found under fake tensors, so trials confirm it.

On the tensor meter a prediction (:mod:`autotune.execution.predict`) counts what a memory trial of the same
configuration counts, to the byte on every model checked so far (``results/dry_run-cpu.md``). Before the search
measures anything, :func:`predict_space` finds each variant's limit over the space's batch sizes with a few
predictions, the space's middle size first. ``auto`` then checks each variant's predictions with one trial (at the
middle size, or at the predicted limit of the plan without recompute), and once a measured trial agrees with its
prediction (within :data:`~autotune.analysis.pareto.PREDICTION_TOLERANCE`), the predictions stand for the variant's
other sizes: its largest fitting batch and the size above it are "implied by prediction" in the limits where they
are clear of the budget by more than the tolerance (:func:`~autotune.analysis.pareto.prediction_fits`,
:func:`~autotune.analysis.pareto.prediction_failures`).

Where the model cannot run under fake tensors, the search goes on without predictions, and says so.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from autotune._log import logger
from autotune.analysis.memory_model import Line
from autotune.analysis.limits import GALLOP, bracket, largest_within
from autotune.errors import first_line
from autotune.records import Config, Measurement, TrialSettings
from autotune.search.space import SearchSpace
from autotune.vocabulary import EAGER, Status, Variant

if TYPE_CHECKING:
    import torch

    from autotune.timing.model import Machine
    from autotune.training.workload import Workload

__all__ = ["predict_space", "exact_limit", "seed", "Seeding", "SEED_SECONDS", "let_go"]

# A search waits this long at most for its predictions: they save trials, and must not cost more than they save
SEED_SECONDS = 60.0
# and this much more for the exact limits between the space's sizes, which save no trial but answer the user's first
# question exactly (about two predictions a variant: TinyGPT's 18 variants of the benchmarks' space take some 40 s)
EXACT_SECONDS = 45.0


def predict_space(space: SearchSpace, predict: Callable[[Config], Measurement], limits: tuple[float, ...],
                  deadline: float | None = None, fixed_bytes: float | None = None,
                  multiple: int | None = None, exact_deadline: float | None = None) -> dict[Config, Measurement]:
    """Each variant's boundary under every one of ``limits``, found over the space's sizes with ``predict`` (memory
    grows with the batch: above a size that does not fit, none does); then, with ``multiple``, each variant's exact
    limit under the first of ``limits`` (:func:`exact_limit`: sizes between the space's, or above its top). Stops
    early, with what it has, past ``deadline`` (``time.monotonic()``; the exact limits past ``exact_deadline``, else
    the same); the variants with the most recompute come first.

    A boundary costs two or three predictions where the variant's peaks lie on a line (:func:`_next_size`):
    the middle size, then the largest size its line says fits, then the size above; where the line misleads, the
    bracket narrows all the same. ``fixed_bytes`` (the state: weights, gradients, optimizer state) anchors a line
    drawn through one point.
    """
    sizes = sorted(space.batch_sizes)
    predictions: dict[Config, Measurement] = {}
    # Compiled variants are not predicted: fake tensors run the eager step (dynamo does not compile under the meter's
    # dispatch mode), and what inductor's kernels hold is known only by running them. They are searched on trials.
    # In the order the search brackets them, the most recompute first, precisions alternating: where the deadline
    # stops the predictions, the variants left to be bracketed by trials are those with the least recompute, whose
    # limits are the smallest batches (the cheapest trials), and the plan without recompute, whose limit is timed anyway.
    variants = [Variant(p, s, EAGER) for s in reversed(space.ordered_plans()) for p in space.precisions
                if EAGER in space.compiles]
    for variant in variants:
        # The space's middle size first: where the search checks a plan's predictions with a trial (cheap, and
        # large enough that activations weigh in), and a point of the plan's line
        if deadline is not None and time.monotonic() > deadline:
            return predictions
        middle = variant.at(sizes[len(sizes) // 2])
        predictions[middle] = predict(middle)
        for limit in limits:
            while True:
                own = {c.batch_size: m for c, m in predictions.items() if c.variant == variant}
                b = _next_size(sizes, own, limit, fixed_bytes)  # the middle size is predicted already
                if b is None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    return predictions
                predictions[variant.at(b)] = predict(variant.at(b))
    if multiple is None or not limits:
        return predictions
    deadline = deadline if exact_deadline is None else exact_deadline
    for variant in variants:  # a second pass: every variant's space bracket comes first, should the deadline stop it
        if deadline is not None and time.monotonic() > deadline:
            return predictions
        exact_limit(variant, predictions, predict, limits[0], multiple, max(sizes), fixed_bytes, deadline)
    return predictions


# The exact limit of a variant whose space's top fits is looked for up to this many times the top (a line carried
# that far past the largest size the user asked for says more of the line than of the model)
ABOVE_TOP = GALLOP


def exact_limit(variant: Variant, predictions: dict[Config, Measurement], predict: Callable[[Config], Measurement],
                limit: float, multiple: int, top: int, fixed_bytes: float | None, deadline: float | None,
                above_top: int = ABOVE_TOP) -> None:
    """Predict ``variant`` between the space's largest size that fits ``limit`` and the next (above the space's top
    where that fits, up to ``above_top`` times it; 1: not above it) until the largest multiple of ``multiple`` that
    fits and the next one are both predicted: :func:`~autotune.analysis.limits.largest_within`'s secant, from the
    variant's line. The predictions made join ``predictions``; nothing where a prediction of the variant failed (the
    model's own error says nothing of memory)."""
    own = {c.batch_size: m for c, m in predictions.items() if c.variant == variant}
    if not own or any(not m.status.measured_memory for m in own.values()):
        return
    fitting = [b for b, m in own.items() if m.fits(limit)]
    lo = max(fitting, default=0)
    above = [b for b, m in own.items() if b > lo and not m.fits(limit)]
    hi = min(above) if above else None
    if (hi is not None and hi - lo <= multiple) or (hi is None and above_top <= 1):
        return  # exact already, or the space's top fits and nothing above it is asked for
    points = {b: float(m.peak_bytes) for b, m in own.items() if m.status == Status.OK and m.peak_bytes}
    line = Line.through(points, fixed_bytes)
    slope = line.slope if line is not None else None
    first = lo + multiple
    if slope and slope > 0 and lo in points:
        first = max(first, int(lo + (limit - points[lo]) / slope))

    def measure(b: int) -> Measurement:
        config = variant.at(b)
        if config not in predictions:
            if deadline is not None and time.monotonic() > deadline:
                raise _OutOfTime
            predictions[config] = predict(config)
        return predictions[config]

    try:
        largest_within(measure, limit, multiple, hi if hi is not None else above_top * top, first,
                       slope if slope and slope > 0 else None)
    except _OutOfTime:
        pass


class _OutOfTime(Exception):
    """The search's time for predictions ran out inside one variant's exact limit."""


def _next_size(sizes: list[int], own: dict[int, Measurement], limit: float, fixed_bytes: float | None) -> int | None:
    """The next size to predict to close one variant's bracket under ``limit``, or None when it is closed (or a
    prediction failed: the model's own error says nothing of memory)."""
    if any(not m.status.measured_memory for m in own.values()):
        return None
    known = bracket(sizes, {b: m.fits(limit) for b, m in own.items()})
    if not known.open:
        return None
    lo, hi, open_ = known.lo, known.hi, known.open
    points = {b: float(m.peak_bytes) for b, m in own.items() if m.status == Status.OK and m.peak_bytes}
    if not points or len(own) >= 3:  # nothing to draw a line through yet, or a line that did not close it
        return sizes[(lo + hi) // 2]
    line = Line.through(points, fixed_bytes)
    if line is None:
        return sizes[(lo + hi) // 2]
    fitting = [i for i in open_ if line.at(sizes[i]) <= limit]
    return sizes[fitting[-1] if fitting else open_[0]]


class Seeding:
    """What the search started from: ``predictions`` (``{config: predicted trial}``, empty where none could be made),
    in how many seconds, and why there are none (``why``) or fewer than asked (``stopped``)."""

    def __init__(self, predictions: dict[Config, Measurement], seconds: float, why: str | None = None,
                 stopped: bool = False, time_model: str | None = None) -> None:
        self.predictions, self.seconds, self.why, self.stopped = predictions, seconds, why, stopped
        self.time_model = time_model  # the machine that priced the predictions' steps (None: no time predicted)

    def in_space(self, space: SearchSpace) -> dict[Config, Measurement]:
        """The predictions of the space's own configurations: what the search's strategy reads (the others are the
        exact limits' sizes between the space's, which only the report's limits read)."""
        return {c: m for c, m in self.predictions.items() if c.batch_size in space.batch_sizes}

    def describe(self) -> dict:
        """The report's ``search.predictions``."""
        return {"configurations": len(self.predictions), "wall_s": round(self.seconds, 3), "unavailable": self.why,
                "stopped_at_time_limit": self.stopped, "time_model": self.time_model}

    @property
    def notices(self) -> tuple[str, ...]:
        if self.why is not None:
            return (f"the search was not seeded by predictions ({self.why}): each limit was bracketed by measurement "
                    f"alone",)
        return ()


def seed(workload: "Workload", space: SearchSpace, *, device: "torch.device", budget_bytes: int | None,
         limits: tuple[float, ...], settings: TrialSettings, fixed_bytes: float | None = None,
         seconds: float = SEED_SECONDS, multiple: int | None = None, time_model: "Machine | None" = None) -> Seeding:
    """Predict each variant's boundaries (:func:`predict_space`; with ``multiple``, each variant's exact limit too)
    under fake tensors, each step's time priced by ``time_model`` where one is given; nothing where the model cannot
    run under them (said in :attr:`Seeding.why`), and whatever was predicted within ``seconds``."""
    from autotune.execution.fake_build import fake_buildable
    from autotune.execution.predict import Unpredictable, fake_tensors, predict_trial, quiet_fake_kernels

    started = time.monotonic()
    mode = fake_tensors()

    def predict(config: Config) -> Measurement:
        return predict_trial(fake, config, device=device, budget_bytes=budget_bytes, settings=settings, mode=mode,
                             time_model=time_model)

    try:
        with quiet_fake_kernels():
            fake = fake_buildable(workload, mode).workload
            predictions = predict_space(space, predict, limits, deadline=started + seconds, fixed_bytes=fixed_bytes,
                                        multiple=multiple, exact_deadline=started + seconds + EXACT_SECONDS)
    except Unpredictable as exc:
        return Seeding({}, time.monotonic() - started, f"the model cannot run under fake tensors: {exc}")
    except Exception as exc:  # noqa: BLE001 - a prediction only saves trials: the search goes on without it
        return Seeding({}, time.monotonic() - started, f"{type(exc).__name__}: {first_line(exc)}")
    finally:
        let_go()
    took = time.monotonic() - started
    if predictions and not any(m.status.measured_memory for m in predictions.values()):  # none says anything of memory
        failed = next(iter(predictions.values()))
        return Seeding({}, took, f"every prediction failed under fake tensors: {failed.error}")
    # stopped inside the space's brackets (the exact limits, which come after them, never began), or inside the exact
    # limits
    exact = any(c.batch_size not in space.batch_sizes for c in predictions)
    stopped = (took > seconds and not exact) or took > seconds + (EXACT_SECONDS if multiple is not None else 0)
    logger.info("predicted %d configurations in %.1f s%s", len(predictions), took,
                " (stopped at the time limit)" if stopped else "")
    return Seeding(predictions, took, stopped=stopped, time_model=None if time_model is None else time_model.name)


def let_go() -> None:
    """Drop what the predictions left in this process: fake tensors' dispatch cache (its entries hold fake tensors
    and their shape environment), and the cycles among the fake models. Trials in this process (the CPU's) would
    otherwise pay for them in every collection and every scan of live objects: ResNetish's memory trials ran about
    30% longer after its predictions before they were let go."""
    import gc

    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()
    gc.collect()

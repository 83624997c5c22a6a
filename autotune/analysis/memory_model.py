"""The memory model: ``peak(b) = fixed + per_sample * b`` per variant (precision, checkpoint plan, compile mode), fitted
to trials.

For a fixed precision and checkpoint plan, peak training memory is the state that does not depend
on the batch (weights, gradients, optimizer moments) plus activations that grow with every sample.
The model fits that line to the measured peaks and predicts plans not measured yet:

* a plan with two or more measured batch sizes gets its own least-squares line;
* a plan with one point shares its precision's intercept (the state is the same whatever the plan),
  fitted jointly over that precision's multi-point plans, else taken from another precision or
  from a hint (the tuner passes 4 x the parameter bytes: weights, gradients and AdamW's moments);
* a plan with no point borrows its per-sample cost: from the same plan in another precision,
  scaled by the ratio the two precisions show on plans measured in both (before there is one, by
  the ratio of their element sizes); else from the line checkpointing draws within one
  precision, per-sample cost against the share ``r`` of blocks a plan recomputes
  (:meth:`autotune.plans.Plan.recompute_share`): ``a(r) = a0 + a1 r``, fitted to that precision's
  measured plans (one plan: a prior that a recomputed block keeps 15% of its activations).

A variant's *mode* is its precision and compile mode: "precision" above reads "mode" (a compiled model's kernels
keep other activations than eager's, so compiled lines share with compiled ones, and borrow from eager ones by the
ratio measured between the two, as precisions do).

The model only guides the search; every limit it reports as measured was measured.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Iterable, Mapping

from autotune.vocabulary import EAGER, PRECISIONS, Plan, Status, Variant
from autotune.records import Measurement

__all__ = ["MemoryLine", "MemoryModel", "Line", "fit_line"]

# Bytes per element of the activations a precision produces (autocast's, or FSDP2's bf16-fsdp): a first guess of how
# precisions compare, replaced by the measured ratio once a plan is measured in both.
_ELEMENT_BYTES = {name: 2 if p.compute_dtype else 4 for name, p in PRECISIONS.items()}


@dataclasses.dataclass(frozen=True)
class MemoryLine:
    """The fitted line of one variant (precision, checkpoint plan, compile mode)."""

    precision: str
    segments: str
    fixed_bytes: float
    per_sample_bytes: float
    points: int  # measured peaks the line was fitted to
    source: str  # "fit" (own line), "shared-intercept" (one point), "predicted" (no point: from other plans)
    max_error_bytes: float | None = None  # largest |measured - fitted| over its points (None without points)
    max_relative_error: float | None = None
    compile: str = EAGER

    @property
    def variant(self) -> Variant:
        return Variant(self.precision, self.segments, self.compile)

    def estimate(self, batch_size: int) -> float:
        """The line's peak bytes at ``batch_size``: an estimate from trials (a prediction runs the step under fake
        tensors)."""
        return self.fixed_bytes + self.per_sample_bytes * batch_size

    def to_dict(self) -> dict:
        return {
            "precision": self.precision,
            "segments": self.segments,
            "compile": self.compile,
            "fixed_bytes": round(self.fixed_bytes),
            "per_sample_bytes": round(self.per_sample_bytes),
            "points": self.points,
            "source": self.source,
            "max_error_bytes": None if self.max_error_bytes is None else round(self.max_error_bytes),
            "max_relative_error": None if self.max_relative_error is None else round(self.max_relative_error, 5),
        }


def _points(measurements: Iterable[Measurement]) -> dict[Variant, dict[int, float]]:
    """Measured peaks of trials that ran to the end, per variant: {batch_size: peak_bytes}."""
    points: dict[Variant, dict[int, float]] = {}
    for m in measurements:
        if m.status == Status.OK and m.peak_bytes:
            points.setdefault(m.config.variant, {})[m.batch_size] = float(m.peak_bytes)
    return points


@dataclasses.dataclass(frozen=True)
class Line:
    """A value against batch size, ``intercept + slope x batch``: peaks (bytes) or step times (seconds)."""

    intercept: float
    slope: float

    def at(self, batch_size: float) -> float:
        return self.intercept + self.slope * batch_size

    @classmethod
    def through(cls, points: Mapping[int, float], fixed: float | None = None) -> "Line | None":
        """The least-squares line through two or more points; through one point and ``fixed`` at batch 0 (the state,
        where it is known and below the point); None where neither can be drawn."""
        if len(points) >= 2:
            return fit_line(points)
        if len(points) == 1 and fixed is not None:
            (b0, y0), = points.items()
            return cls(fixed, (y0 - fixed) / b0) if y0 > fixed else None
        return None


def fit_line(pts: Mapping[int, float]) -> Line:
    """The least-squares :class:`Line` through two or more (batch size, value) points (peaks here, step times in the
    search's time model)."""
    n = len(pts)
    sx, sy = sum(pts), sum(pts.values())
    sxx, sxy = sum(b * b for b in pts), sum(b * y for b, y in pts.items())
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return Line((sy - slope * sx) / n, slope)


def _shared_intercept(plans: list[dict[int, float]]) -> float | None:
    """The intercept that fits several plans best when each keeps its own slope (closed form)."""
    num = den = 0.0
    for pts in plans:
        sb, sbb = sum(pts), sum(b * b for b in pts)
        sy, sby = sum(pts.values()), sum(b * y for b, y in pts.items())
        num += sy - sby * sb / sbb
        den += len(pts) - sb * sb / sbb
    return num / den if den > 1e-9 else None


_KEPT = 0.15  # prior, before two plans of a precision are measured: a recomputed block keeps this share


def _prior(r: float) -> float:
    """Per-sample activations at recompute share ``r``, relative to no checkpointing (the prior's shape)."""
    return 1.0 - (1.0 - _KEPT) * r


def _shape_fit(slopes: dict[float, float]) -> Callable[[float], float]:
    """Per-sample bytes against the recompute share, ``a0 + a1 r``, fitted to {share: per-sample bytes}."""
    if len(slopes) == 1 or len(set(slopes)) == 1:
        r0, a = next(iter(slopes.items()))
        scale = a / _prior(r0) if _prior(r0) > 0 else a
        return lambda r: scale * _prior(r)
    a0, a1, _ = _least_squares([(1.0, r, 0.0) for r in slopes], list(slopes.values()))
    return lambda r: a0 + a1 * r


def _least_squares(rows: list[tuple[float, float, float]], ys: list[float]) -> tuple[float, float, float]:
    """Solve the normal equations of a three-column least-squares problem; unused columns stay 0."""
    import numpy as np

    x, y = np.array(rows), np.array(ys)
    used = [j for j in range(3) if np.any(x[:, j])]
    coef = np.zeros(3)
    sol, *_ = np.linalg.lstsq(x[:, used], y, rcond=None)
    coef[used] = sol
    return float(coef[0]), float(coef[1]), float(coef[2])


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Fitted or predicted lines for the variants of a search; see the module docstring."""

    lines: dict[Variant, MemoryLine]

    @classmethod
    def fit(cls, measurements: Iterable[Measurement], variants: Iterable[Variant], *,
            fixed_bytes_hint: float | None = None, blocks: int | None = None) -> "MemoryModel":
        """Fit a line per variant; ``blocks`` is the model's L, which plan names count in."""
        variants = [Variant(*v) for v in dict.fromkeys(variants)]
        points = _points(measurements)
        modes = list(dict.fromkeys(v.mode for v in variants + list(points)))
        # The state is on the device for every plan but those that hold it in host memory (+state): an intercept
        # is shared per precision and where the state lives.
        intercept: dict[tuple[tuple[str, str], bool], float] = {}
        for p in modes:
            for state in (False, True):
                multi = [pts for v, pts in points.items() if v.mode == p and Plan(v.plan).state == state and len(pts) >= 2]
                shared = _shared_intercept(multi) if multi else None
                if shared is not None:
                    intercept[p, state] = max(shared, 0.0)

        def fixed_of(variant: Variant) -> float:
            """The intercept a variant's line shares: its mode's where the state lives, else the median of any
            mode's there, else the hint (the state on the device) or nothing (the state on the host)."""
            state = Plan(variant.plan).state
            if (variant.mode, state) in intercept:
                return intercept[variant.mode, state]
            mine = [v for (_, s), v in intercept.items() if s == state]
            return statistics.median(mine) if mine else (0.0 if state else fixed_bytes_hint or 0.0)
        models: dict[Variant, MemoryLine] = {}
        for variant, pts in points.items():
            line = Line.through(pts, None if len(pts) >= 2 else fixed_of(variant))
            if line is None:  # one point at or below the shared intercept: it says more than the guess
                (b, y), = pts.items()
                line = Line(y * 0.5, y * 0.5 / b)
            fixed, slope = line.intercept, line.slope
            source = "fit" if len(pts) >= 2 else "shared-intercept"
            slope = max(slope, 1.0)
            errors = [abs(y - (fixed + slope * b)) for b, y in pts.items()]
            models[variant] = MemoryLine(variant.precision, variant.plan, fixed, slope, len(pts), source, max(errors),
                                         max(e / y for e, y in zip(errors, pts.values())), variant.compile)
        slopes = {variant: m.per_sample_bytes for variant, m in models.items()}
        for variant in variants:
            if variant not in models:
                slope = _borrowed_slope(variant, slopes, blocks)
                if slope is not None:
                    models[variant] = MemoryLine(variant.precision, variant.plan, fixed_of(variant), slope, 0, "predicted",
                                                 compile=variant.compile)
        return cls(models)

    def estimate(self, variant: Variant, batch_size: int) -> float | None:
        """The memory line's peak bytes for ``variant`` at ``batch_size`` (an estimate from trials, not a prediction
        under fake tensors), or None where nothing is known yet."""
        model = self.lines.get(variant)
        return None if model is None else model.estimate(batch_size)

    def relative_error(self) -> float:
        """The largest relative residual over lines fitted to three or more points (0 when none)."""
        return max((m.max_relative_error for m in self.lines.values() if m.points >= 3 and m.max_relative_error), default=0.0)

    def to_list(self) -> list[dict]:
        return [self.lines[variant].to_dict() for variant in sorted(self.lines, key=lambda v: (v.compile != EAGER, v))]


def _borrowed_slope(variant: Variant, slopes: dict[Variant, float], blocks: int | None) -> float | None:
    """Per-sample bytes for a variant with no measurement, from the variants that have one (by mode: precision and
    compile mode, see the module's docstring)."""
    mode, name = variant.mode, variant.plan
    others = [q for q in dict.fromkeys(v.mode for v in slopes) if q != mode]

    def at(q: tuple[str, str], plan: str) -> Variant:
        return Variant(q[0], plan, q[1])

    def ratio(q: tuple[str, str]) -> float | None:  # per-sample cost of `mode` relative to `q`, on shared plans
        shared = [slopes[at(mode, v.plan)] / slopes[v] for v in slopes if v.mode == q and at(mode, v.plan) in slopes]
        return statistics.median(shared) if shared else None

    def along_shape(of: tuple[str, str]) -> float | None:  # the recompute-share line of mode `of`, at this plan
        # The line is drawn through block plans (their share is exact); a selective plan's share is a prior. Plans
        # that offload keep a line of their own: what they keep (or their state) waits on the host.
        mine = {v.plan: a for v, a in slopes.items() if v.mode == of and Plan(v.plan).offload_mode == Plan(name).offload_mode}
        drawn = {s: a for s, a in mine.items() if not Plan(s).selective} or mine
        own = {Plan(s).recompute_share(blocks): a for s, a in drawn.items()}
        if not own:
            return None
        value = _shape_fit(own)(Plan(name).recompute_share(blocks))
        return value if math.isfinite(value) and value > 0 else min(own.values())

    for q in others:  # the same plan in another mode, scaled
        if at(q, name) in slopes and ratio(q) is not None:
            return slopes[at(q, name)] * ratio(q)
    value = along_shape(mode)
    if value is not None:
        return value
    for q in others:  # no plan measured in both: scale by the activations' element size
        scale = _ELEMENT_BYTES.get(mode[0], 4) / _ELEMENT_BYTES.get(q[0], 4)
        if at(q, name) in slopes:
            return slopes[at(q, name)] * scale
        theirs = along_shape(q)
        if theirs is not None:
            return scale * theirs
    return None

"""Each variant's limit exact, from the search's predictions: the largest batch that fits and the next one.

The search's predictions (:mod:`autotune.search.predicted`) find each variant's limit between the space's sizes
(or above its top) under fake tensors, in steps of ``--batch-multiple``. Where they stand (a measured trial agrees
with its own prediction: :func:`~autotune.analysis.pareto.confirmed`), :func:`exact_limits` makes a limit row exact
with them: its ``max_batch_size`` and ``min_oom_batch_size`` become neighbours, each side measured where a trial ran
there and else predicted (``max_rule`` / ``min_oom_rule`` ``prediction``, with the predicted bytes and the confirming
trial), and ``exact`` says so. A predicted side is a prediction, labelled as one in the JSON and the table; the
recommended variant's is confirmed by real trials after the search (:func:`autotune.refine.exact_limit`). No torch.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from autotune.analysis.pareto import confirmed
from autotune.records import Config, Measurement
from autotune.vocabulary import Variant

__all__ = ["exact_limits"]

_PREDICTED_SIDES = ("max_implied_by", "max_rule", "max_predicted_bytes", "min_oom_implied_by", "min_oom_rule",
                    "min_oom_predicted_bytes")


def exact_limits(rows: list[dict], measurements: Iterable[Measurement], predictions: Mapping[Config, Measurement],
                 budget_bytes: int | None, multiple: int) -> list[dict]:
    """``rows`` (:func:`~autotune.analysis.pareto.batch_limits`) with each variant's limit made exact where its
    standing predictions, with the measurements, put the largest fitting size and a failing one ``multiple`` or
    less apart, agreeing with the row's measured sides. Rows it cannot make exact are returned as they were,
    with ``exact`` False (True where measurements alone are exact)."""
    if budget_bytes is None:
        return rows
    measurements = list(measurements)
    standing = confirmed(measurements, predictions) if predictions else {}
    out = []
    for row in rows:
        variant = Variant(row["precision"], row["segments"], row["compile"])
        measured = {m.batch_size: m for m in measurements if m.config.variant == variant and m.status.measured_memory}
        row = dict(row)
        if variant in standing:
            row = _exact(row, variant, measured, predictions, budget_bytes, multiple, str(standing[variant]))
        lo, hi = row["max_batch_size"], row["min_oom_batch_size"]
        row["exact"] = hi is not None and (lo or 0) + multiple >= hi
        if row["exact"] and "bracketed" in row:
            row["bracketed"] = True  # the largest fit and the next size known: the space's sizes around them too
        out.append(row)
    return out


def _exact(row: dict, variant: Variant, measured: Mapping[int, Measurement],
           predictions: Mapping[Config, Measurement], budget_bytes: int, multiple: int, source: str) -> dict:
    """``row`` made exact by ``variant``'s predictions (``source``: the trial its predictions stand on), or as it was."""
    predicted = {c.batch_size: p for c, p in predictions.items() if c.variant == variant and p.status.measured_memory}
    fits = {b: p.fits(budget_bytes) for b, p in predicted.items()} | {b: m.fits(budget_bytes) for b, m in measured.items()}
    lo = max((b for b, ok in fits.items() if ok), default=0)
    failing = [b for b, ok in fits.items() if not ok and b > lo]
    hi = min(failing) if failing else None
    if any(not ok for b, ok in fits.items() if b <= lo):
        return row  # a size fails below one that fits: memory does not grow with the batch here, nothing is exact
    if (row["max_batch_size"] or 0) > lo or (hi is not None and row["min_oom_batch_size"] is not None
                                             and hi > row["min_oom_batch_size"]):
        return row  # the row's sides (measured or implied otherwise) say more
    if ((hi is None or hi - lo > multiple) and lo <= (row["max_batch_size"] or 0)) or (
            (lo or None, hi) == (row["max_batch_size"], row["min_oom_batch_size"])):
        return row  # nothing closer than the row
    row = {k: v for k, v in row.items() if k not in _PREDICTED_SIDES}
    row["max_batch_size"] = lo or None
    if lo and lo not in measured:
        row.update(max_implied_by=source, max_rule="prediction", max_predicted_bytes=predicted[lo].peak_bytes)
    row["min_oom_batch_size"] = hi
    if hi is not None and hi not in measured:
        row.update(min_oom_implied_by=source, min_oom_rule="prediction",
                   min_oom_predicted_bytes=predicted[hi].peak_bytes)
    return row

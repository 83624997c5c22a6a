"""Where a batch-size limit lies, and how it is found in few trials: the bracket among a space's sizes (:class:`Bracket`),
and the exact limit in steps of a multiple, by bisection (:func:`bisect_limit`) or along the line of peaks against
batch size (:func:`largest_within`, the secant). Shared by the search, the dry run, the refinement and the evaluation
limits. No torch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from autotune.records import Measurement
from autotune.vocabulary import Status

__all__ = ["Bracket", "bracket", "Limit", "bisect_limit", "largest_within", "GALLOP"]


@dataclasses.dataclass(frozen=True)
class Bracket:
    """Where a variant's limit lies among a space's sizes: ``lo``, the index of the largest size known to fit (-1 when
    none does), and ``hi``, of the smallest above it known not to (``len(sizes)`` when none above ``lo`` fails)."""

    lo: int
    hi: int

    @property
    def closed(self) -> bool:
        """The limit is bracketed: the next size above the largest that fits does not."""
        return self.hi == self.lo + 1

    @property
    def open(self) -> range:
        """The indices between the two, whose outcome is not known."""
        return range(self.lo + 1, self.hi)


def bracket(sizes: Sequence[int], outcomes: Mapping[int, bool]) -> Bracket:
    """The :class:`Bracket` of ``outcomes`` (size -> fits) among ``sizes`` (ascending)."""
    fits = [i for i, b in enumerate(sizes) if outcomes.get(b) is True]
    lo = max(fits, default=-1)
    hi = min((i for i, b in enumerate(sizes) if i > lo and outcomes.get(b) is False), default=len(sizes))
    return Bracket(lo, hi)


@dataclasses.dataclass(frozen=True)
class Limit:
    """A limit found in steps of a multiple: the largest size that fits (0: none does) and the next multiple, which
    does not (None: the top asked about fits); ``measured``: what was measured (or predicted) on the way, by size."""

    max_batch_size: int
    min_oom_batch_size: int | None
    measured: dict[int, Measurement] = dataclasses.field(default_factory=dict)


def bisect_limit(fits: Callable[[int], bool], lo: int, hi: int, multiple: int = 1) -> Limit:
    """The largest batch size that fits and the next multiple of ``multiple`` above it, between ``lo`` (known to fit;
    0 where none is) and ``hi`` (known not to), asking ``fits`` of multiples of ``multiple`` only.

    Memory grows with the batch, so every size below one that fits fits too: the answer is exact in steps of
    ``multiple`` (where ``lo`` is no multiple and the first multiple above it fails, ``lo`` is the answer).
    """
    a, b = lo // multiple, -(-hi // multiple)  # a x multiple <= lo fits; b x multiple >= hi does not
    while b - a > 1:
        middle = (a + b) // 2
        if fits(middle * multiple):
            a = middle
        else:
            b = middle
    return Limit(max(lo, a * multiple), b * multiple)


GALLOP = 32  # a line followed up from a size that fits goes at most this many times past it at once


def largest_within(measure: Callable[[int], Measurement], limit_bytes: float, multiple: int, top: int,
                   first: int, per_sample_bytes: float | None = None) -> Limit:
    """The largest multiple of ``multiple`` up to ``top`` whose measurement fits ``limit_bytes`` (0 where none does),
    the next multiple above it (None where ``top`` fits) and every measurement made, by batch size.

    Memory grows with the batch, nearly along a line: from ``first``, each next size is where the line through the
    two measured sizes nearest the limit meets it (the secant), kept strictly between the sizes known to fit and
    not to fit, so that a guess that fits is followed by the size above it. Without a size known not to fit, one
    size doubles (there is no line yet), a line is followed up to ``GALLOP`` times the largest fit, and a line that
    ends at the largest fit is checked a stride above it (the stride doubling each time it is); where a guess of the
    line fails to halve the bracket, the next size halves it. ``per_sample_bytes`` (the line's slope, known from
    elsewhere) draws the line through one measured size, so that a ``first`` that is the limit is followed by the size
    above it. A measurement neither ``ok`` nor ``oom`` (the model's own failure) ends the search there: the caller
    finds it among the measurements.
    """
    seen: dict[int, Measurement] = {}
    lo, hi, stride, slow, secant = 0, None, multiple, False, False
    size = min(max(multiple, first // multiple * multiple), top // multiple * multiple)
    while size >= multiple:
        m = seen[size] = measure(size)
        if m.status not in (Status.OK, Status.OOM):
            break
        width = (hi if hi is not None else size) - lo
        lo, hi = (size, hi) if m.fits(limit_bytes) else (lo, size if hi is None else min(hi, size))
        if (hi is not None and hi - lo <= multiple) or (hi is None and lo + multiple > top):
            break
        slow = secant and hi is not None and 2 * (hi - lo) > width  # the line's last guess did not halve the bracket
        guess = _secant(seen, lo, hi, limit_bytes, multiple, per_sample_bytes)
        if hi is None:  # a line carries past the largest fit (up to GALLOP times it); one ending there is checked above
            size = min(guess, GALLOP * lo) if guess is not None and guess > lo else \
                2 * lo if guess is None else lo + stride
            stride = 2 * stride if guess is not None and guess <= lo else stride
            size = min(size, top // multiple * multiple)
        elif guess is None or slow:
            size = max(lo + multiple, (lo + hi) // 2 // multiple * multiple)
        else:
            size = min(max(guess, lo + multiple), hi - multiple)
        secant = hi is not None and guess is not None and not slow
    return Limit(lo, hi, seen)


def _secant(seen: Mapping[int, Measurement], lo: int, hi: int | None, limit_bytes: float, multiple: int,
            per_sample_bytes: float | None = None) -> int | None:
    """Where the line through the largest size that fits and the smallest that does not (else the second largest
    that fits; else through one of them at ``per_sample_bytes``) meets ``limit_bytes``, down to a multiple of
    ``multiple``; None where there is no rising line."""
    peaks = {b: m.peak_bytes for b, m in seen.items() if m.peak_bytes is not None and m.status in (Status.OK, Status.OOM)}
    anchor = lo if lo in peaks else hi if hi in peaks else None
    if anchor is None:
        return None
    below = sorted(b for b in peaks if b < lo)
    other = (hi if hi in peaks else below[-1] if below else None) if anchor == lo else None
    rise = (peaks[other] - peaks[anchor]) / (other - anchor) if other is not None else per_sample_bytes
    if not rise or rise <= 0:
        return None
    return int((anchor + (limit_bytes - peaks[anchor]) / rise) // multiple * multiple)

"""How the ranks of a ``--parallel`` job agree on one outcome of a piece of work.

An outcome on any rank is the work's on every rank, in the order oom > crashed > timeout >
failed; a rank's error caused only by another rank leaving the group counts last. An
interruption on any rank wins over everything, then bad input. A trial's peak is the largest
rank's (each rank's is kept); throughput is global: world size x micro-batch over the slowest
rank's step, each step's time taken as the slowest rank's (the ranks agree after every timed step,
so they also stop timing at the same step).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from autotune.execution.job import RankInterrupted, RankRefused
from autotune.records import Measurement, ProbeResult, timing_fields
from autotune.vocabulary import Status

if TYPE_CHECKING:
    from autotune.execution.job import Job

__all__ = ["ORDER", "combine", "combine_probe", "probe_left_early", "stopped"]

ORDER = (Status.OOM, Status.CRASHED, Status.TIMEOUT, Status.FAILED)  # which rank's outcome is the work's
# What a rank's error says when only another rank's leaving caused it (gloo's closed pair, NCCL's abort).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo", "nccl", "disterror",
              "distbackenderror", "distnetworkerror")


def _probe_status(r: ProbeResult) -> str:
    """The outcome a rejected candidate's reason starts with ("oom", "failed", ...); a verdict's first words else."""
    return (r.reason or "").split(":")[0]


def probe_left_early(r: ProbeResult) -> bool:
    """Whether a rank's candidate stopped before the others could: "oom: ...", "failed: ..." came from an
    exception, a verdict (a non-finite loss, too little headroom) from a finished run."""
    return not r.accepted and _probe_status(r) in ORDER


def stopped(parts: list[Any]) -> "RankInterrupted | RankRefused | None":
    """An interruption on any rank, else bad input on any rank: it ends the job, whatever the others measured."""
    return next((p for p in parts if isinstance(p, RankInterrupted)), None) or next(
        (p for p in parts if isinstance(p, RankRefused)), None)


def _origin(outcomes: list[tuple[str, str] | None]) -> int | None:
    """The rank whose outcome is the job's: per rank its (status, error text), None where it went well.

    The first in the order oom > crashed > timeout > failed > anything else; among failures, one that
    only says another rank left the trial's group (not a cause of its own) comes last.
    """
    def key(status: str, text: str) -> tuple[int, bool]:
        gone = status == Status.FAILED and any(word in text.lower() for word in _PEER_GONE)
        return (ORDER.index(status) if status in ORDER else len(ORDER), gone)

    ranked = [(key(*o), r) for r, o in enumerate(outcomes) if o is not None]
    return min(ranked)[1] if ranked else None


def _largest(items: list[Any], field: str) -> Any:
    """The largest of the ranks' ``field`` (None where no rank has one)."""
    values = [getattr(item, field) for item in items if getattr(item, field) is not None]
    return max(values) if values else None


def combine(parts: list[Measurement | RankInterrupted | RankRefused], job: "Job") -> Measurement | RankInterrupted | RankRefused:
    """The trial's one measurement from every rank's (index = rank); an interruption anywhere wins, then bad input.

    The outcome is the first rank's in the order oom > crashed > timeout > failed (a failure that
    only says another rank left comes last), its error prefixed with the rank. Peaks are the largest
    rank's; step times are already the slowest rank's (agreed each step), and samples/s count every
    rank's micro-batch.
    """
    first_stop = stopped(parts)
    if first_stop:
        return first_stop
    ms: list[Measurement] = list(parts)  # type: ignore[arg-type]
    origin = _origin([None if m.status == Status.OK else (m.status, m.error or "") for m in ms])
    first = ms[0] if origin is None else ms[origin]
    ok = first.status == Status.OK
    times = tuple(ms[0].step_times_s) if ok else ()
    tokens = [None if m.tokens_per_s is None else m.tokens_per_s * sum(m.step_times_s) for m in ms]
    real = round(sum(tokens)) if tokens and None not in tokens and times else None
    ranks = [{"rank": r, "status": m.status.value, "peak_bytes": m.peak_bytes, "step_s": m.step_s,
              **({"host_peak_bytes": m.host_peak_bytes} if m.host_peak_bytes is not None else {}),
              **({"error": m.error} if m.error else {})} for r, m in enumerate(ms)]
    return dataclasses.replace(
        first,
        error=None if origin is None else f"rank {origin}: {first.error}",
        peak_bytes=_largest(ms, "peak_bytes"),
        peak_allocated_bytes=_largest(ms, "peak_allocated_bytes"),
        peak_reserved_bytes=_largest(ms, "peak_reserved_bytes"),
        peak_nvml_bytes=_largest(ms, "peak_nvml_bytes"),
        host_peak_bytes=_largest(ms, "host_peak_bytes"),  # each rank's own (they may share a host: ranks say each)
        optimizer_step_share=_largest(ms, "optimizer_step_share"),
        **timing_fields(first.config.batch_size * job.world_size, times, real, ok),
        wall_s=max(m.wall_s for m in ms),
        setup_s=max((m.setup_s for m in ms if m.setup_s is not None), default=None),
        steps_s=max((m.steps_s for m in ms if m.steps_s is not None), default=None),
        distributed={**job.describe((first.config.precision,)), "outcome_rank": origin, "ranks": ranks},
    )


def combine_probe(parts: list[Any], job: "Job") -> Any:
    """A candidate's one probe result from every rank's: accepted when every rank accepted it.

    A rejection is the first rank's in the order oom > crashed > timeout > failed > a verdict (a
    non-finite loss, a collapsed loss scale, too little headroom); worst peaks are the largest
    rank's; samples count every rank's share, over the slowest rank's steps (agreed each step).
    """
    first_stop = stopped(parts)
    if first_stop:
        return first_stop
    rs: list[ProbeResult] = list(parts)
    origin = _origin([None if r.accepted else (_probe_status(r), r.reason or "") for r in rs])
    first = rs[0]
    samples = sum(r.samples for r in rs)
    rate = sum(r.samples_per_s for r in rs) if origin is None and all(r.samples_per_s for r in rs) else None
    return dataclasses.replace(
        first,
        accepted=origin is None,
        reason=None if origin is None else f"rank {origin}: {rs[origin].reason}",
        samples=samples,
        samples_per_s=rate,  # each rank's samples over the same (slowest) times: their sum is the job's rate
        peak_bytes_max=_largest(rs, "peak_bytes_max"),
        worst_batch_peak_bytes=_largest(rs, "worst_batch_peak_bytes"),
        peak_bytes_median=_largest(rs, "peak_bytes_median"),
        peak_reserved_bytes_max=_largest(rs, "peak_reserved_bytes_max"),
        nonfinite_losses=sum(r.nonfinite_losses for r in rs),
        wall_s=max(r.wall_s for r in rs),
        distributed={**job.describe((first.config.precision,)), "outcome_rank": origin, "ranks": [
            {"rank": i, "accepted": r.accepted, "peak_bytes_max": r.peak_bytes_max, "samples": r.samples,
             **({"reason": r.reason} if r.reason else {})} for i, r in enumerate(rs)]},
    )

"""When nothing fits: by how much, and which levers the search left untried, as figures (no advice).

The library says what it measured; the command line words it as advice with its flags
(:func:`autotune.cli.advice.nothing_fits`), and :class:`~autotune.errors.NothingFits` carries it for the API.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.records import usable_bytes
from autotune.units import format_bytes
from autotune.vocabulary import ALL, SIXTEEN_BIT, TRUE, Parallel, Plan

__all__ = ["Shortfall", "shortfall"]


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """What a report that recommends nothing says about why: its figures, and the levers its search did not try."""

    budget_bytes: int | None
    headroom: float
    statuses: tuple[str, ...]  # the trials' outcomes, sorted
    probe_rejections: tuple[tuple[str, str], ...] = ()  # (configuration, reason) of each probed candidate rejected
    smallest: tuple[int, str, str] | None = None  # the smallest peak measured: (bytes, configuration, status)
    state_bytes: int | None = None  # the weights, gradients and optimizer state a step holds whatever the batch
    state_over_half: bool = False  # the state alone is over half the usable budget
    sharded_ranks: int | None = None  # FSDP2's ranks the state was already sharded over (a rank's share was measured)
    hosted: bool = False  # plans +state were searched: the state was already off the device
    floor: dict[str, Any] | None = None  # batch 1 with every block recomputed (autotune.plans.floor)
    untried: tuple[str, ...] = ()  # levers the space left out: "all blocks" (its floor fits), "half", "half state"
    # (bf16-true, where the state is over half the budget), "checkpointing", "batch 1", "offload"
    dry_run: bool = False

    @property
    def state_share(self) -> float | None:
        """This rank's share of the state: all of it, or FSDP2's shard of it."""
        if not self.state_bytes:
            return None
        return self.state_bytes / self.sharded_ranks if self.sharded_ranks else self.state_bytes

    def floor_need(self) -> float | None:
        """What a step needs at least (batch 1, every block recomputed): this rank's share of the state and the
        activations measured; None where the floor was not measured."""
        if not self.floor or not self.state_bytes:
            return None
        return self.state_share + self.floor["activations"]

    def why(self) -> str:
        """One sentence of figures: the budget, the outcomes, the smallest peak, and what batch 1 needs at least."""
        if self.probe_rejections:
            return f"every probed candidate was rejected ({'; '.join(f'{c}: {r}' for c, r in self.probe_rejections)})"
        least = (f"; the smallest peak measured was {format_bytes(self.smallest[0])} ({self.smallest[1]}, "
                 f"{self.smallest[2]})" if self.smallest else "")
        floor = self.floor
        if floor and self.state_bytes:
            share = self.state_share
            hosted = (f"; with the state in host memory the activations and the gathered block's weights, "
                      f"{format_bytes(floor['activations'] + floor['block_weights'])}"
                      if self.hosted and "block_weights" in floor else "")
            least += (f"; at batch 1 with every block recomputed a step needs about "
                      f"{format_bytes(self.floor_need())} ({format_bytes(share)} of weights, gradients and "
                      f"optimizer state{' on each rank' if self.sharded_ranks else ''}, "
                      f"{format_bytes(floor['activations'])} of activations, measured at {floor['precision']}{hosted})")
        return (f"nothing fits within {format_bytes(self.budget_bytes)} less {self.headroom:.0%} headroom "
                f"(trial outcomes: {', '.join(self.statuses)}){least}")


def shortfall(report: Any) -> Shortfall:
    """The :class:`Shortfall` of ``report`` (an :class:`autotune.report.Report` that recommends nothing)."""
    statuses = tuple(sorted({str(m.status) for m in report.trials}))
    if report.probe:
        return Shortfall(report.budget_bytes, report.headroom, statuses,
                         probe_rejections=tuple((str(r.config), r.reason) for r in report.probe))
    measured = [m for m in report.trials if m.peak_bytes is not None and m.status.measured_memory]
    smallest = min(measured, key=lambda m: m.peak_bytes, default=None)
    space = report.search.space
    plans = [Plan(s) for s in space["segments"]]
    state = report.workload.get("fixed_bytes")
    held = [sum(parts.values()) for name, parts in (report.workload.get("state_by_precision") or {}).items()
            if name in space["precisions"] and None not in parts.values()]
    state = min([state, *held]) if state is not None and held else state  # bf16-true's, where searched: smaller
    sharded = (report.distributed or {}).get("wrapper") == Parallel.FSDP
    usable = usable_bytes(report.budget_bytes, report.headroom)
    over_half = bool(state and usable and state > 0.5 * usable)
    untried = tuple(lever for lever, left_out in (
        ("half", not set(SIXTEEN_BIT) & set(space["precisions"])),
        ("half state", over_half and not set(TRUE) & set(space["precisions"])),
        ("checkpointing", all(p.off for p in plans) and bool(report.workload.get("chain"))),
        ("batch 1", min(space["batch_sizes"]) > 1),
        ("offload", report.environment.get("device_type") == "cuda" and not any(p.offload for p in plans)),
    ) if left_out)
    short = Shortfall(
        report.budget_bytes, report.headroom, statuses,
        smallest=(smallest.peak_bytes, str(smallest.config), str(smallest.status)) if smallest else None,
        state_bytes=state, state_over_half=over_half,
        sharded_ranks=report.distributed["world_size"] if sharded else None,
        hosted=any(p.state for p in plans), floor=report.workload.get("floor"), untried=untried, dry_run=report.dry_run)
    need = short.floor_need()
    if need is not None and usable and need <= usable and not any(p.base == ALL for p in plans):
        short = dataclasses.replace(short, untried=("all blocks", *untried))  # its floor fits: recompute every block
    return short

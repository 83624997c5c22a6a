"""Where work runs: one operation, run a piece of work and return its result, and three kinds of venue.

* :class:`Here`: in this process (``--isolation none``).
* :class:`~autotune.execution.spawn.Spawned`: in a fresh spawned worker process, so that a crash,
  a sticky CUDA error or a fragmented allocator stays there (``--isolation process``).
* :class:`~autotune.execution.ranks.Ranks`: on every rank of a torchrun job, under DDP or FSDP2,
  the ranks agreeing on one outcome (``--parallel ddp|fsdp``, on rank 0).

Every venue is a :class:`~autotune.execution.work.Venue`. The tuner picks the venue once (:func:`venue_for`, in its first stage); trials, probe candidates
and plan checks are pieces of work (:class:`~autotune.execution.work.Work`) that any venue runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from autotune.execution.work import Place, Venue, Work
from autotune.vocabulary import Isolation

if TYPE_CHECKING:
    from autotune.execution.job import Job
    from autotune.meters import Meter
    from autotune.training.workload import Workload

__all__ = ["Here", "venue_for"]


class Here(Venue):
    """In this process, with the device's meter (or ``meter``, when the caller has one)."""

    kind = Isolation.NONE.value

    def __init__(self, device: torch.device | str, meter: "Meter | None" = None) -> None:
        super().__init__(device)
        self.meter = meter

    @property
    def slows_steps(self) -> bool:
        return self.meter.slows_steps if self.meter is not None else super().slows_steps

    def run(self, workload: "Workload", work: Work) -> Any:
        return work.run(workload, Place(self.device, self.meter))


def venue_for(isolation: str, device: torch.device, job: "Job | None" = None, *,
              trials_per_worker: int | None = None) -> Venue:
    """The venue for ``--isolation`` (``none`` or ``process``, already resolved) or, with ``job``, every rank.

    ``trials_per_worker`` caps the trials one worker process serves (``process``; 1: a fresh one each).
    """
    if job is not None:
        from autotune.execution.ranks import Ranks

        return Ranks(device, job)
    if isolation == Isolation.PROCESS:
        from autotune.execution.spawn import Spawned

        return Spawned(device, trials_per_worker)
    return Here(device)

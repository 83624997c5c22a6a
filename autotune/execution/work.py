"""A piece of work a venue runs: a trial, a probe candidate or a plan check, as one picklable value.

A venue (:mod:`autotune.execution.venue`) runs work in this process, in a spawned worker or on
every rank of a torchrun job, and knows nothing of what the work is. The work knows the rest:

* how it runs at a :class:`Place` (the device, the meter, this rank's part of a job);
* how a failure of the venue itself (a worker that crashed, hung or raised) becomes its record;
* how the ranks of a job agree on one outcome (:mod:`autotune.execution.agreement`);
* how its result crosses a process boundary (``encode``/``decode``: the records' plain dicts).

The one place that decides what an exception means for any work is :func:`outcome`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from autotune.errors import TrialTimeoutError, UsageError, first_line, is_device_crash, is_oom
from autotune.vocabulary import Status
from autotune.execution.job import rank_budget
from autotune.meters import Meter

if TYPE_CHECKING:
    from autotune.execution.job import Job
    from autotune.training.wrapping import Wrapping
    from autotune.training.workload import Workload

__all__ = ["Place", "Work", "Venue", "Outcome", "outcome"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a piece of work records for a failure: its status and the error's line."""

    status: Status
    error: str


def outcome(exc: Exception) -> Outcome:
    """The :class:`Outcome` a piece of work records for ``exc``; re-raise bad input (:class:`UsageError`).

    The one place that decides what a failure is: trials, the probe and every venue agree.
    """
    if isinstance(exc, UsageError):
        raise exc
    if isinstance(exc, TrialTimeoutError):
        return Outcome(Status.TIMEOUT, str(exc))
    if is_oom(exc):
        return Outcome(Status.OOM, first_line(exc))
    if is_device_crash(exc):  # a sticky CUDA error: the device is unusable, as if the worker had died
        return Outcome(Status.CRASHED, f"{type(exc).__name__}: {first_line(exc)}")
    return Outcome(Status.FAILED, f"{type(exc).__name__}: {first_line(exc)}")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a piece of work runs: the device, the meter it measures with, and its rank's part of a job."""

    device: torch.device
    meter: Meter | None = None  # a meter the caller chose (in this process); None: the device's, for the work's budget
    parallel: "Wrapping | None" = None  # --parallel: this rank's process group and wrapper for the work

    def budget(self, budget_bytes: int | None) -> int | None:
        """The budget this rank enforces: ``budget_bytes``, or the smaller one a rank may be given."""
        return budget_bytes if self.parallel is None else rank_budget(budget_bytes, self.parallel.job.rank)

    def meter_for(self, budget_bytes: int | None, *, compiled: bool = False) -> Meter:
        """The meter to measure with, enforcing this rank's share of ``budget_bytes``; ``compiled``: one that sees
        the memory of compiled code (:meth:`autotune.device.Backend.meter`)."""
        if self.meter is not None:
            return self.meter
        from autotune.device import backend_for

        return backend_for(self.device).meter(self.budget(budget_bytes), compiled=compiled)


class Work(abc.ABC):
    """The contract between a piece of work and the venue that runs it (see the module docstring)."""

    name: str = "autotune-work"  # a spawned worker's process name
    every_rank: bool = True  # False: in a --parallel job the leader runs it alone (the plan checks)

    @property
    def timeout_s(self) -> float | None:
        """The limit of the whole piece of work, in seconds (a spawned worker gets its start-up on top)."""
        return None

    @abc.abstractmethod
    def run(self, workload: "Workload", place: Place) -> Any:
        """Run the work in this process; failures of the user's code are part of the result, not exceptions."""

    @abc.abstractmethod
    def failed(self, status: str, error: str, seconds: float) -> Any:
        """The result of work whose venue failed it: ``status`` crashed, timeout or failed; ``error`` one line
        about the venue ("worker process killed by SIGKILL")."""

    def agree(self, parts: list[Any], job: "Job") -> Any:
        """The one result of every rank's (index = rank); an interruption or bad input on any rank wins."""
        raise NotImplementedError(f"{type(self).__name__} runs on one rank only")

    def left_early(self, result: Any) -> bool:
        """Whether this rank's ``result`` came from an exception (it left its process group before the others)."""
        return True

    def encode(self, result: Any) -> Any:
        """``result`` as plain data, to cross a process boundary."""
        return result.to_dict()

    def decode(self, data: Any) -> Any:
        """The result :meth:`encode` made ``data`` from."""
        raise NotImplementedError


class Venue(abc.ABC):
    """Runs pieces of work on one device (on every rank of a job: each rank's own)."""

    kind: str  # "none", "process" or "ranks": what the report's search.isolation says

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    @property
    def slows_steps(self) -> bool:
        """Whether the meter the work measures with slows steps down (then timing runs unmetered)."""
        from autotune.device import backend_for

        return backend_for(self.device).meter_class.slows_steps

    def admit(self, workload: "Workload") -> None:
        """Raise :class:`~autotune.errors.UsageError` (one line) now if this venue could not run ``workload``."""

    @abc.abstractmethod
    def run(self, workload: "Workload", work: Work) -> Any:
        """Run ``work`` on ``workload`` here; return its result (failures are results; bad input raises)."""

    def describe(self) -> dict[str, Any]:
        """What the report's ``search`` says of this venue beyond its kind (the workers it started, say)."""
        return {}

    def close(self) -> None:
        """Let go of what the venue holds between pieces of work (a warm worker); it may be used again after."""

    def __enter__(self) -> "Venue":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

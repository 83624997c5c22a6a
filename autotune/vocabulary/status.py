"""How a trial, and a plan's check, ended: one enum each, like Optuna's ``TrialState``.

Each member is also its string (``Status.OK == "ok"``), so the JSON and the trial store keep the words
they always had, and a report written before the enum reads back the same. A new status is a member
here, with what the search does with it: whether its trial is a measurement that stands
(:attr:`Status.state`, the Optuna state it is stored as) and, where the code must act on it, its
handling there.
"""

from __future__ import annotations

import enum

__all__ = ["Status", "CheckStatus"]


class Status(str, enum.Enum):
    """How a trial ended."""

    OK = "ok"  # it trained its steps within the budget
    OOM = "oom"  # out of memory: the budget (or the device, or the host's for offloaded plans) was exceeded
    TIMEOUT = "timeout"  # stopped at the trial's time limit
    FAILED = "failed"  # an error that is not memory: the trial says nothing of the configuration's limits
    CRASHED = "crashed"  # its worker process died, or CUDA became unusable

    def __str__(self) -> str:
        return self.value

    @property
    def state(self) -> str:
        """The Optuna ``TrialState`` the trial store keeps it as: ``COMPLETE`` for a measurement, ``PRUNED`` for an
        outcome the search learns from (a limit), ``FAIL`` for one it does not."""
        return {Status.OK: "COMPLETE", Status.OOM: "PRUNED", Status.TIMEOUT: "PRUNED"}.get(self, "FAIL")

    @property
    def measured_memory(self) -> bool:
        """Whether a trial that ended so says how much memory its configuration needs (at least its peak for an OOM)."""
        return self in (Status.OK, Status.OOM)


class CheckStatus(str, enum.Enum):
    """How a checkpoint plan's check ended: the plan against no plan, one small step on the user's model."""

    EXACT = "exact"  # the same loss and gradients, bit for bit: kept
    WITHIN_NOISE = "within_noise"  # within the model's own run-to-run noise: kept
    DIFFERS = "differs"  # beyond it: the plan trains another model, dropped
    FAILED = "failed"  # the check could not run: dropped

    def __str__(self) -> str:
        return self.value

    @property
    def kept(self) -> bool:
        """Whether the search trusts the plan."""
        return self in (CheckStatus.EXACT, CheckStatus.WITHIN_NOISE)

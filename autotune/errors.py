"""One exception root for autotune, and the one predicate that recognises an out-of-memory error."""

from __future__ import annotations

import torch

__all__ = [
    "AutotuneError",
    "UsageError",
    "Interrupted",
    "BudgetExceededError",
    "TrialTimeoutError",
    "is_oom",
    "first_line",
]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class UsageError(AutotuneError):
    """Bad input from the user: the message says what is wrong and how to fix it (CLI exit code 2)."""


class Interrupted(AutotuneError):
    """The search was interrupted (Ctrl-C); ``report`` holds what was measured so far, marked partial."""

    def __init__(self, report: object) -> None:
        super().__init__("interrupted; finished trials are kept in the store: run the same command to continue")
        self.report = report


class TrialTimeoutError(AutotuneError):
    """A trial ran past its time limit (``--trial-timeout``)."""


class BudgetExceededError(torch.OutOfMemoryError):
    """Live tensor bytes crossed the memory budget enforced by the tensor meter.

    It subclasses ``torch.OutOfMemoryError`` and is raised with a single message argument that
    contains "DefaultCPUAllocator: can't allocate memory", so that any PyTorch OOM handler
    (ours, Lightning's ``is_oom_error``, accelerate's ``should_reduce_batch_size``) treats it
    as a real out-of-memory error.
    """

    def __init__(self, requested_bytes: int, live_bytes: int, budget_bytes: int) -> None:
        from autotune.units import format_bytes

        super().__init__(
            f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {requested_bytes} "
            f"bytes with {format_bytes(live_bytes)} live, over the autotune budget of "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes)."
        )
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.budget_bytes = budget_bytes


_OOM_MESSAGES = (
    "out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input",
)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def is_oom(exc: BaseException) -> bool:
    """Return True when ``exc`` is an out-of-memory error from any PyTorch device."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError) and exc.args and isinstance(exc.args[0], str):
        return any(text in exc.args[0] for text in _OOM_MESSAGES)
    return False

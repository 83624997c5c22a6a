"""One exception root for autotune, and the predicates that recognise out-of-memory and device crashes.

Nothing here imports torch (a torch exception exists only once torch is loaded): records and the
analysis modules raise these errors on a machine without it. The out-of-memory error the tensor
meter raises, a ``torch.OutOfMemoryError``, lives with torch in :mod:`autotune.meters.oom`.
"""

from __future__ import annotations

import sys

__all__ = [
    "AutotuneError",
    "UsageError",
    "Interrupted",
    "NothingFits",
    "StateDoesNotFit",
    "TrialTimeoutError",
    "is_oom",
    "is_device_crash",
    "first_line",
]


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class UsageError(AutotuneError):
    """Bad input from the user: the message says what is wrong and how to fix it (CLI exit code 2)."""


class ForwardFailed(UsageError):
    """The preflight's forward pass raised: the model, its data or its loss is wrong, unless a dry run's fake tensors
    were stricter than the real kernels (a fake kernel that takes bf16 only); ``cause`` is what it raised, in a line."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class Interrupted(AutotuneError):
    """The search was interrupted (Ctrl-C); ``report`` holds what was measured so far, marked partial."""

    def __init__(self, report: object) -> None:
        super().__init__("interrupted; finished trials are kept in the store: run the same command to continue")
        self.report = report


class NothingFits(AutotuneError):
    """Nothing fits the budget (the CLI's exit 3), raised where an answer was to be written back (a trainer's
    settings): ``report`` holds every trial, and the message what to try."""

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report


class StateDoesNotFit(NothingFits):
    """The model's training state alone (weights, gradients, the optimizer's state) exceeds the budget, so no trial
    could fit: raised before any trial runs (no report: ``report`` is None). ``state`` holds the bytes by part; the
    message (one line) names the levers that would fit, with figures. ``floor`` is the smallest plan's activations at
    batch 1 (:class:`autotune.plans.floor.Floor`), None where they could not be measured."""

    def __init__(self, message: str, state: dict[str, int], floor: object = None) -> None:
        super().__init__(message, None)
        self.state = state
        self.floor = floor


class TrialTimeoutError(AutotuneError):
    """A trial ran past its time limit (``--trial-timeout``)."""


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
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError) and exc.args and isinstance(exc.args[0], str):
        return any(text in exc.args[0] for text in _OOM_MESSAGES)
    return False


# A CUDA error other than out-of-memory is sticky: the context is unusable and every later call fails.
_CRASH_MESSAGES = ("CUDA error:", "CUDA driver error", "CUBLAS_STATUS_EXECUTION_FAILED", "cudaErrorIllegalAddress")


def is_device_crash(exc: BaseException) -> bool:
    """Return True when ``exc`` says the device is unusable (an illegal address, a device-side assert).

    Such a trial is recorded as ``crashed``, as if its worker process had died: the error is the
    device's state, not an outcome of the configuration that a retry in this process could change.
    """
    if is_oom(exc):
        return False
    if type(exc).__name__ == "AcceleratorError":  # torch >= 2.8 raises CUDA errors as torch.AcceleratorError
        return True
    text = str(exc.args[0]) if exc.args else ""
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _CRASH_MESSAGES)

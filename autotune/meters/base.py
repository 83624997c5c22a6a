"""The one small interface every memory meter implements."""

from __future__ import annotations

import abc
import contextlib
import dataclasses

__all__ = ["Meter", "MemoryReading", "Measuring"]


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    """Peak memory of one measured region, in bytes.

    ``peak_bytes`` is the figure the budget is compared to: tracked live tensor bytes for the
    tensor meter, the caching allocator's reserved bytes on CUDA. The other fields are filled
    where the meter can read them and are ``None`` elsewhere.
    """

    peak_bytes: int
    peak_allocated_bytes: int | None = None  # torch.cuda.max_memory_allocated, or tracked tensors
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved
    peak_nvml_bytes: int | None = None  # device memory used, sampled through NVML (all processes)
    source: str = ""  # which meter produced it: "tensor" or "cuda"


class Meter(abc.ABC):
    """Measure the peak memory of a region of training code, and enforce a budget.

    Use ``with meter.measure() as handle: ...``; after the block, ``handle.reading`` holds the
    :class:`MemoryReading`. When a budget is set, exceeding it inside the region raises an error
    that :func:`autotune.errors.is_oom` recognises (a ``torch.OutOfMemoryError``); the reading
    is still filled in. A meter is reusable: each ``measure()`` starts from a fresh peak.
    """

    #: True when metering slows the measured code down, so timing must run outside it.
    slows_steps: bool = False

    def __init__(self, *, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes

    @abc.abstractmethod
    def measure(self, *, deadline: float | None = None) -> contextlib.AbstractContextManager["Measuring"]:
        """Return a context manager that measures the peak memory of its block.

        ``deadline`` (a ``time.monotonic()`` value) lets a meter that sees every operator stop the
        block with :class:`~autotune.errors.TrialTimeoutError`; meters that cannot, ignore it.
        """

    def close(self) -> None:
        """Undo any process-wide setting the meter made (for example a CUDA memory fraction)."""


class Measuring:
    """Handle yielded by :meth:`Meter.measure`; ``reading`` is set when the block ends.

    ``reset_peak()`` and ``peak_bytes()`` measure a part of the region, such as one step.
    """

    reading: MemoryReading | None = None

    def reset_peak(self) -> None:
        """Start a new peak from the memory in use now."""
        raise NotImplementedError

    def peak_bytes(self) -> int:
        """Return the peak since the region began or since :meth:`reset_peak`, in bytes."""
        raise NotImplementedError


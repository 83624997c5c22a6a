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

    When the region raised an out-of-memory error, ``oom_held_bytes`` is what was held when the
    failing allocation was made and ``oom_needed_bytes`` that plus the allocation that failed: the
    least the region needed (``None`` when the failed size is unknown). ``peak_bytes`` is then at
    least ``oom_needed_bytes`` when it is known, else at least ``oom_held_bytes``: a lower bound on
    the region's need, above the budget when the budget was what refused it.
    """

    peak_bytes: int
    peak_allocated_bytes: int | None = None  # torch.cuda.max_memory_allocated, or tracked tensors
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved
    peak_nvml_bytes: int | None = None  # device memory used, sampled through NVML (all processes)
    source: str = ""  # which meter produced it: "tensor" or "cuda"
    oom_held_bytes: int | None = None  # held when the allocation failed (reserved on CUDA, tracked on CPU)
    oom_needed_bytes: int | None = None  # oom_held_bytes plus the size of the allocation that failed


class Meter(abc.ABC):
    """Measure the peak memory of a region of training code, and enforce a budget.

    Use ``with meter.measure() as handle: ...``; after the block, ``handle.reading`` holds the
    :class:`MemoryReading`. When a budget is set, exceeding it inside the region raises an error
    that :func:`autotune.errors.is_oom` recognises (a ``torch.OutOfMemoryError``); the reading
    is still filled in. A meter is reusable: each ``measure()`` starts from a fresh peak.

    A meter changes no process-wide setting outside ``measure()``: whatever it sets to enforce
    the budget (a CUDA memory fraction) is set on entering the region and put back on leaving it,
    also when the region raised.
    """

    #: True when metering slows the measured code down, so timing must run outside it.
    slows_steps: bool = False
    #: False for a meter that cannot measure compiled code (a dispatch mode: dynamo runs the code eager under it).
    sees_compiled: bool = True
    #: True where a prediction under fake tensors (:mod:`autotune.execution.predict`) counts what this meter counts,
    #: to the byte: a search may then start from predictions and let a confirmed one stand for a trial.
    predicted_exactly: bool = False

    def __init__(self, *, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes

    @abc.abstractmethod
    def measure(self, *, deadline: float | None = None) -> contextlib.AbstractContextManager["Measuring"]:
        """Return a context manager that measures the peak memory of its block.

        ``deadline`` (a ``time.monotonic()`` value) lets a meter that sees every operator stop the
        block with :class:`~autotune.errors.TrialTimeoutError`; meters that cannot, ignore it.
        """


class Measuring:
    """Handle yielded by :meth:`Meter.measure`; ``reading`` is set when the block ends.

    ``reset_peak()``, ``peak_bytes()`` and ``peak_reserved_bytes()`` measure a part of the region,
    such as one step. Resetting does not lower the region's reading, which keeps the largest peak.
    """

    reading: MemoryReading | None = None

    def reset_peak(self) -> None:
        """Start new peaks from the memory in use now."""
        raise NotImplementedError

    def peak_bytes(self) -> int:
        """Return the peak of allocated bytes (live tensors) since the region began or :meth:`reset_peak`.

        On CUDA this is ``torch.cuda.max_memory_allocated``, which falls back between steps as
        tensors are freed; for the tensor meter, tracked live tensor bytes.
        """
        raise NotImplementedError

    def peak_reserved_bytes(self) -> int | None:
        """Return the peak of reserved bytes since the region began or :meth:`reset_peak`; ``None`` without one.

        On CUDA this is ``torch.cuda.max_memory_reserved``: the caching allocator keeps freed
        blocks, so it starts each step from what the earlier steps left cached. The tensor meter
        has no allocator, and no reserved figure.
        """
        return None


"""Where and how a trial's training runs: ``--parallel`` and ``--isolation`` by name (no torch here).

Each member is also its string (``Parallel.FSDP == "fsdp"``), as :class:`~autotune.vocabulary.status.Status` is:
the flags, the JSON and the trial store keep the words they always had.
"""

from __future__ import annotations

import enum

__all__ = ["Parallel", "Isolation"]


class Parallel(str, enum.Enum):
    """How one trial's training is spread (``--parallel``): in one process, or over torchrun's ranks, each wrapping
    the model as PyTorch's data parallelism does (:mod:`autotune.execution.ranks`)."""

    NONE = "none"  # one process trains the whole batch
    DDP = "ddp"  # DistributedDataParallel: every rank holds the whole state, gradients all-reduced
    FSDP = "fsdp"  # FSDP2's fully_shard on each block and the root: the state sharded over the ranks

    def __str__(self) -> str:
        return self.value

    @property
    def sharded(self) -> bool:
        """Whether each rank holds only its shard of the training state."""
        return self is Parallel.FSDP


class Isolation(str, enum.Enum):
    """Where a trial runs (``--isolation``): in a warm worker process, or in this one."""

    AUTO = "auto"  # PROCESS on CUDA (a sticky error or a fragmented cache stays in the worker), NONE on the CPU
    PROCESS = "process"  # a warm worker, replaced when a trial leaves it unclean
    NONE = "none"  # this process

    def __str__(self) -> str:
        return self.value

"""The out-of-memory error the tensor meter raises: a real ``torch.OutOfMemoryError``."""

from __future__ import annotations

import torch

from autotune.units import format_bytes

__all__ = ["BudgetExceededError"]


class BudgetExceededError(torch.OutOfMemoryError):
    """Live tensor bytes crossed the memory budget enforced by the tensor meter.

    It subclasses ``torch.OutOfMemoryError`` and is raised with a single message argument that
    contains "DefaultCPUAllocator: can't allocate memory", so that any PyTorch OOM handler
    (ours, Lightning's ``is_oom_error``, accelerate's ``should_reduce_batch_size``) treats it
    as a real out-of-memory error.
    """

    def __init__(self, requested_bytes: int, live_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {requested_bytes} "
            f"bytes with {format_bytes(live_bytes)} live, over the autotune budget of "
            f"{format_bytes(budget_bytes)} ({budget_bytes} bytes)."
        )
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.budget_bytes = budget_bytes

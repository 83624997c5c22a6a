"""Warm models: a model built once (a template) and copied for each trial, and the random states its build drew from.

A copy is exact and new: its parameters and buffers are fresh tensors, each made by an allocation and a copy (a meter
in force counts them as the trial's own), tied parameters stay tied, and the build's random draws are replayed so that
what follows the build (dropout masks, data order) is as after a fresh build. Used by
:meth:`autotune.training.workload.Workload.warm` and by the dry run's fake copies of a model built for real.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports

__all__ = ["copy_model", "copyable", "RandomStates"]


def copy_model(template: nn.Module) -> nn.Module:
    """An exact copy of ``template`` whose parameters and buffers are new tensors, each made by an allocation and a copy.

    Not ``copy.deepcopy`` alone: a parameter's deep copy passes through ``.data``, an alias of the
    template's storage, which a meter in force (the tensor meter) would count as the trial's.
    Tied parameters stay tied; everything else is deep-copied as usual.
    """
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for t in (*template.parameters(), *template.buffers()):
            if id(t) not in memo:
                fresh = torch.empty_like(t).copy_(t)
                kind = nn.Parameter if is_fake(t) else type(t)  # a fake parameter's type is FakeTensor (a dry run's)
                memo[id(t)] = kind(fresh, t.requires_grad) if isinstance(t, nn.Parameter) else fresh
    return copy.deepcopy(template, memo)


def copyable(template: nn.Module) -> bool:
    """Whether :func:`copy_model` can copy ``template``, found without a second copy of its weights in memory:
    everything but its parameters and buffers deep-copied (they are shared through the memo), and each parameter's
    type rebuilt around an empty tensor."""
    tensors = (*template.parameters(), *template.buffers())
    try:
        copy.deepcopy(template, {id(t): t for t in tensors})
        for t in tensors:
            if isinstance(t, nn.Parameter):
                type(t)(torch.empty(0, dtype=t.dtype), t.requires_grad)
    except Exception:  # noqa: BLE001 - whatever stops a copy: the model is built every time instead
        return False
    return True


@dataclasses.dataclass(frozen=True)
class RandomStates:
    """The random states a model's build may draw from: torch's on the CPU (a tensor), Python's, NumPy's."""

    torch_cpu: torch.Tensor
    python: Any
    numpy: Any

    @classmethod
    def now(cls) -> "RandomStates":
        import random

        import numpy

        return cls(torch.get_rng_state(), random.getstate(), numpy.random.get_state())

    def restore(self) -> None:
        """Set every generator back to these states (what follows a copy is as after the build)."""
        import random

        import numpy

        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        numpy.random.set_state(self.numpy)

"""A dry run's models under fake tensors: built there where their build runs under them, else built once for real and
copied as fake tensors (:func:`fake_buildable`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.errors import first_line
from autotune.training.copies import copy_model
from autotune.training.workload import Workload

__all__ = ["FakeBuild", "fake_buildable", "FakeCopies"]


@dataclasses.dataclass(frozen=True)
class FakeBuild:
    """The workload a dry run builds its models from under fake tensors, and what to say of it (None: nothing)."""

    workload: Workload
    notice: str | None = None


def fake_buildable(workload: Workload, mode: FakeTensorMode) -> FakeBuild:
    """The workload whose models a dry run builds under ``mode``: as it is where its build runs under fake tensors;
    else (a build that reads a value: timm computes its drop-path rates with ``.item()``) a workload whose every
    build copies one model built for real on the CPU, its weights' memory for a moment, and turned into fake tensors.
    Returns it and, in the second case, what to say (:class:`FakeBuild`). A build that fails for real too raises as
    a search's would."""
    try:
        with mode:
            workload.build_model(seed=0)
        return FakeBuild(workload)
    except Exception as exc:  # noqa: BLE001 - whatever the fake build met, a real build says whether it is the model's
        why = f"{type(exc).__name__}: {first_line(exc)}"
    template = _fakeified(workload.build_model(seed=0), mode)
    built = dataclasses.replace(workload, model_factory=FakeCopies(template, workload.model_factory))
    return FakeBuild(built, f"{workload.name} cannot be built under fake tensors ({why}): it was built once for real "
                            f"on the CPU, its weights made fake tensors, and each prediction starts from a copy of it")


class FakeCopies:
    """A model factory that copies a fake template; ``real`` is the factory it stands in for (a model that also needs
    real values in its steps is measured with real builds of it)."""

    def __init__(self, template: torch.nn.Module, real: Any) -> None:
        self.template, self.real = template, real

    def __call__(self) -> torch.nn.Module:
        return copy_model(self.template)


def _fakeified(model: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """``model`` with every parameter and buffer replaced by a fake tensor of ``mode`` (tied parameters stay tied); the
    real ones are let go."""
    fakes: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None:
                        if id(t) not in fakes:
                            fake = mode.from_tensor(t.detach())
                            fakes[id(t)] = (torch.nn.Parameter(fake, t.requires_grad)
                                            if isinstance(t, torch.nn.Parameter) else fake)
                        table[name] = fakes[id(t)]
    return model

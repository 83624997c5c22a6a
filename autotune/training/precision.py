"""Precision modes: fp32, fp16 autocast with a GradScaler, bf16 autocast without one, bf16-fsdp: FSDP2's
``MixedPrecisionPolicy`` (bf16 parameters gathered and computed with, fp32 gradient reduction), no autocast, and
bf16-true: the model itself in bf16 (weights, so gradients and optimizer state), no autocast, no GradScaler.

Which modes a device runs is the device backend's to say (:mod:`autotune.device`); the FSDP2 policy is applied where
the model is wrapped (:mod:`autotune.training.wrapping`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import torch
from torch.utils._pytree import tree_map

from autotune.errors import UsageError
from autotune.vocabulary import GROWTH_INTERVAL, INIT_LOSS_SCALE, PRECISIONS

__all__ = ["MODES", "PrecisionMode", "get_mode", "keep_in_fp32", "INIT_LOSS_SCALE"]


@dataclasses.dataclass(frozen=True)
class PrecisionMode:
    """How one precision mode trains: the autocast dtype (None for fp32 and bf16-fsdp), whether it scales the loss,
    and for bf16-fsdp the dtypes of FSDP2's policy."""

    name: str
    autocast_dtype: torch.dtype | None
    uses_scaler: bool
    param_dtype: torch.dtype | None = None  # FSDP2's MixedPrecisionPolicy: parameters gathered in this dtype
    reduce_dtype: torch.dtype | None = None  # ... and gradients reduced in this one
    weight_dtype: torch.dtype | None = None  # bf16-true: the model's floating parameters and buffers held in this dtype

    def hold(self, model: torch.nn.Module) -> None:
        """A true mode (bf16-true): cast ``model``'s floating parameters and buffers to its dtype in place (its integer
        buffers stay), as Lightning's ``precision="bf16-true"`` converts the module, and cast the floating tensors of
        every forward call's inputs to it too, as Lightning converts the batch (a forward pre-hook on ``model``).
        Nothing for the other modes."""
        if self.weight_dtype is None:
            return
        _cast(model, self.weight_dtype)
        if getattr(model, _INPUT_CAST, None) is None:  # once, however often the model is prepared
            setattr(model, _INPUT_CAST, model.register_forward_pre_hook(
                functools.partial(_cast_inputs, self.weight_dtype), with_kwargs=True))

    def mp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` of this mode (``fully_shard(..., mp_policy=...)``), None for the autocast
        modes and fp32 (FSDP2's default policy: parameters and reduction in their own dtype)."""
        if self.param_dtype is None:
            return None
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Return the autocast context for a forward pass on ``device_type`` (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def grad_scaler(self, device_type: str) -> "torch.amp.GradScaler | None":
        """Return a fresh GradScaler starting at 2**16 for fp16, ``None`` for the other modes."""
        if not self.uses_scaler:
            return None
        return torch.amp.GradScaler(device_type, init_scale=INIT_LOSS_SCALE, growth_interval=GROWTH_INTERVAL)


_INPUT_CAST = "_autotune_input_cast"  # the handle of a true mode's input cast, on the model it casts for


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)``, by ``.data`` where ``Module._apply`` would swap tensors (fake ones: a dry run's, whose swap a
    weak reference refuses): the same parameter objects, tied ones still tied, integer buffers as they are."""
    cast: dict[int, torch.Tensor] = {}  # a buffer shared by modules stays shared
    with torch.no_grad():
        for module in model.modules():
            for param in module._parameters.values():
                if param is not None and param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                    module._buffers[name] = cast.setdefault(id(buffer), buffer.to(dtype))


def _cast_inputs(dtype: torch.dtype, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def down(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return tree_map(down, args), tree_map(down, kwargs)


def _dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


# The ground floor's precisions (autotune.vocabulary.PRECISIONS, what each name means) as modes that run: torch's dtypes
MODES: dict[str, PrecisionMode] = {
    name: PrecisionMode(name, _dtype(p.autocast_dtype), p.uses_scaler, _dtype(p.param_dtype), _dtype(p.reduce_dtype),
                        _dtype(p.weight_dtype))
    for name, p in PRECISIONS.items()
}


def get_mode(name: str) -> PrecisionMode:
    """Return the :class:`PrecisionMode` called ``name`` ("fp32", "fp16", "bf16", "bf16-fsdp" or "bf16-true")."""
    try:
        return MODES[name]
    except KeyError:
        raise UsageError(f"unknown precision {name!r}: choose from {', '.join(MODES)}") from None


def keep_in_fp32(model: torch.nn.Module, class_names: tuple[str, ...], device_type: str) -> list[str]:
    """Run every module whose class is named in ``class_names`` outside autocast, on float32 inputs.

    Returns the paths of the modules changed; raises :class:`UsageError` for a name the model lacks.
    """
    if not class_names:
        return []
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in class_names if n not in present]
    if missing:
        raise UsageError(
            f"--fp32-modules {','.join(missing)}: {type(model).__name__} has no module of that type "
            f"(it has {', '.join(sorted(present)[:12])}{', ...' if len(present) > 12 else ''})"
        )
    changed = []
    for path, module in model.named_modules():
        if type(module).__name__ in class_names:
            module.forward = functools.partial(_fp32_forward, module.forward, device_type)
            changed.append(path)
    return changed


def _fp32_forward(forward: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
    def up(t: Any) -> Any:
        return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    with torch.autocast(device_type, enabled=False):
        return forward(*tree_map(up, args), **tree_map(up, kwargs))

"""A model's key/value cache, off in training while a plan recomputes: as transformers does under its own checkpointing.

A transformers model keeps ``use_cache=True`` in its config, as ``from_config`` and ``from_pretrained`` give it, and
its forward then writes each layer's keys and values into a cache it returns. A block recomputed for backward writes
them again: the cache has grown between the forward and its replay, and the recompute sees other shapes
(``aten.slice.Tensor invocation index 4 encountered during backward but not found in storage``, or a mask that no
longer broadcasts). transformers turns the cache off while its own gradient checkpointing trains (in training mode,
with gradients on), with a warning; a plan here does the same, for the same calls, and says so
(:func:`~autotune.thirdparty.training_caches` finds the modules). Evaluation and generation (no gradients, or
``model.eval()``) keep the cache, as in transformers.

The switch is a forward pre-hook on each module that builds a cache: ``use_cache=False`` in the call, whether the
caller passed it or left it to the config, so the config itself is never changed; :func:`restore` removes it.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from autotune.thirdparty import training_caches

__all__ = ["turn_off", "restore"]

_HOOKS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # module -> its hook's handle


def turn_off(model: nn.Module) -> list[str]:
    """Turn the key/value cache of ``model``'s modules off in training; return their classes' names (none: nothing
    builds a cache)."""
    names = []
    for module in training_caches(model):
        if module not in _HOOKS:
            index = list(inspect.signature(module.forward).parameters).index("use_cache")
            _HOOKS[module] = module.register_forward_pre_hook(_without_cache(index), with_kwargs=True)
        names.append(type(module).__name__)
    return names


def restore(model: nn.Module) -> None:
    """Undo :func:`turn_off` on every module of ``model``."""
    for module in model.modules():
        handle = _HOOKS.pop(module, None)
        if handle is not None:
            handle.remove()


def _without_cache(index: int) -> Any:
    """A forward pre-hook that sets ``use_cache=False`` (argument ``index`` of the forward, or its keyword) in a call
    that trains: the module in training mode, gradients on."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if len(args) > index:
            args = (*args[:index], False, *args[index + 1:])
        else:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    return hook

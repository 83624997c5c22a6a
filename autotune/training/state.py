"""The training state a step holds whatever the batch, by part, and what other levers would leave of it.

A true precision (``bf16-true``) holds the weights, their gradients and the optimizer's state in its dtype: its state
is measured as the others' is, by twins of the user's optimizer (:func:`autotune.training.optimizer.prime`) over zero
tensors of that dtype. When the state does not fit, the answer names every lever with its figure for the user's model
(:class:`autotune.plans.floor.SmallerState`): bf16-true, an 8-bit optimizer (bitsandbytes' ``AdamW8bit``, from its
layout: it trains on CUDA), a factored one (``torch.optim.Adafactor``, from its layout) and adapters (LoRA on every
Linear layer of the repeated blocks, counted from their shapes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch
from torch import nn

from autotune.plans.checkpointing import Chain
from autotune.plans.floor import ADAPTER_RANK, EIGHT_BIT_BLOCK, SmallerState
from autotune.training.optimizer import OptimizerSpec, measure_state_bytes

__all__ = ["held_parts", "eight_bit_state_bytes", "factored_state_bytes", "Adapters", "adapter_parameters", "smaller_state",
           "EIGHT_BIT_MIN_SIZE"]

# bitsandbytes' 8-bit blockwise state (bitsandbytes/optim/optimizer.py, Optimizer2State.init_state, 0.45 to 0.50): a
# parameter of at least min_8bit_size entries keeps its two moments as uint8 codes with a float32 absmax per block of
# 256 entries; a smaller one keeps them in float32; the two quantization maps (256 float32 each) are the optimizer's,
# one pair for all its parameters
EIGHT_BIT_MIN_SIZE = 4096
_QMAPS_BYTES = 2 * 256 * 4


def held_parts(model: nn.Module, spec: OptimizerSpec, lr: float, dtype: torch.dtype) -> dict[str, int | None]:
    """The state with the model held in ``dtype`` (bf16-true's): its weights and the trained ones' gradients in that
    dtype where they are floating, and the optimizer's state measured by twins in it (None where it cannot be)."""
    size = torch.empty((), dtype=dtype).element_size()
    params = list(model.parameters())

    def cast_bytes(p: torch.Tensor) -> int:
        return p.numel() * (size if p.is_floating_point() else p.element_size())

    optimizer = measure_state_bytes(spec, model, lr, dtype=dtype)
    return {"weights": sum(map(cast_bytes, params)),
            "gradients": sum(cast_bytes(p) for p in params if p.requires_grad), "optimizer_state": optimizer}


def eight_bit_state_bytes(numels: Iterable[int], *, block: int = EIGHT_BIT_BLOCK,
                          min_8bit_size: int = EIGHT_BIT_MIN_SIZE) -> int:
    """Bytes of bitsandbytes' ``AdamW8bit`` state for parameters of ``numels`` entries, from its layout (module
    constants): 2 bytes an entry and 8 per block of 256 for a large parameter, 8 bytes an entry for a small one, and
    its two quantization maps once."""
    sizes = list(numels)
    eight = [n for n in sizes if n >= min_8bit_size]
    return (sum(2 * n + 2 * 4 * math.ceil(n / block) for n in eight) + sum(8 * n for n in sizes if n < min_8bit_size)
            + (_QMAPS_BYTES if eight else 0))


@dataclasses.dataclass(frozen=True)
class Adapters:
    """LoRA adapters counted on a model: their ``parameters`` and the ``layers`` adapted."""

    parameters: int = 0
    layers: int = 0


def adapter_parameters(model: nn.Module, chain: Chain | None, rank: int = ADAPTER_RANK) -> Adapters:
    """LoRA of ``rank`` on every Linear layer of the repeated blocks (PEFT's ``target_modules="all-linear"`` less the
    output layer, which lies outside them): the adapters' parameters and the layers adapted. A layer of ``in x out``
    weights adds ``rank x (in + out)``; transformers' ``Conv1D`` (GPT-2's) counts as the Linear it is."""
    count = layers = 0
    for path in chain.blocks if chain is not None else ():
        for module in model.get_submodule(path).modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D") and weight is not None \
                    and weight.ndim == 2:
                count += rank * sum(weight.shape)
                layers += 1
    return Adapters(count, layers)


def factored_state_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of ``torch.optim.Adafactor``'s state for ``params`` (trained ones), from its layout (``_init_group``, torch
    2.5 to 2.13): a float32 step, and in the parameter's dtype a row and a column factor of the second moment for a
    matrix (a tensor of two or more dimensions: its size less the last dimension, and less the one before it), the
    whole second moment for a vector. Its twins cannot run under fake tensors (the step reads a value)."""
    total = 0
    for p in params:
        shape = tuple(p.shape)
        moments = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if len(shape) > 1 else p.numel()
        total += 4 + moments * p.element_size()
    return total


def smaller_state(model: nn.Module, chain: Chain | None, spec: OptimizerSpec, lr: float, state: dict[str, int], *,
                  true_runs: bool, true_searched: bool) -> SmallerState:
    """The figures of every lever for ``model``'s state (``state``: the parts counted, the optimizer's included):
    bf16-true where the device runs it and it was not what was counted, the 8-bit and factored optimizers where their
    state is smaller than the optimizer's, the adapters where the blocks have Linear layers and nothing is frozen."""
    trained = [p for p in model.parameters() if p.requires_grad]
    eight_bit = eight_bit_state_bytes(p.numel() for p in trained)
    factored = factored_state_bytes(trained)
    true = held_parts(model, spec, lr, torch.bfloat16) if true_runs and not true_searched else None
    # a model with frozen parameters (a PEFT model's base) has its adapters already: no lever of adapters to offer
    adapters = adapter_parameters(model, chain) if len(trained) == len(list(model.parameters())) else Adapters()
    below = state["optimizer_state"]
    return SmallerState(
        true_parts=true if true is not None and true["optimizer_state"] is not None else None,
        eight_bit_bytes=eight_bit if eight_bit < below else None,
        factored_bytes=factored if factored < below else None,
        adapter_parameters=adapters.parameters, adapter_layers=adapters.layers, parameters=sum(p.numel() for p in model.parameters()),
    )

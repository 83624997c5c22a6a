"""The activations no plan gets below: the smallest plan's, at batch 1, measured by saved-tensor hooks.

When a model's state alone exceeds the budget, the levers that would fit it (FSDP ranks, the state in host
memory) still need room for the activations of one step at the smallest batch. This measures them before any
trial, in forward passes only (no backward: no gradients are allocated), on the model as it is given: on the
CPU, or under PyTorch's fake tensors, where no memory is allocated at all (``autotune.preparation`` tries those
first). Storages are told apart by their StorageImpl, which views share and fake tensors have:

- ``kept``: what plan ``all`` (every block recomputed) keeps from forward to backward: each block's inputs
  and what runs between blocks, the bytes autograd saves, parameters and buffers left out;
- ``recompute``: the most that one block saves when it runs without a plan, which the backward pass holds
  again while it recomputes that block (it recomputes one block at a time).

A model without repeated blocks has no plan but ``0``: ``kept`` is then what its forward pass saves, and
``recompute`` is 0. Storages are counted once however many tensors view them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autotune.plans.checkpointing import Chain, apply_plan, remove_plan
from autotune.records import usable_bytes
from autotune.units import format_bytes
from autotune.vocabulary import PrecisionName


@dataclasses.dataclass(frozen=True)
class Floor:
    """The smallest plan's activations at batch 1 (module docstring), and the largest block's weights."""

    kept: int
    recompute: int
    block_weights: int  # the largest block's parameters: what FSDP gathers, or offloading brings back, at once
    precision: str = PrecisionName.FP32.value  # the autocast it was measured under (the caller's)

    @property
    def activations(self) -> int:
        return self.kept + self.recompute


ADAPTER_RANK = 8  # the LoRA rank the adapters' lever is counted at (PEFT's default r, LitGPT's resource tables')
EIGHT_BIT_BLOCK = 256  # bitsandbytes' 8-bit blockwise state: one float32 scale per block of this many entries


@dataclasses.dataclass(frozen=True)
class SmallerState:
    """What other levers would leave of the training state, in bytes, each for the user's model (the does-not-fit
    answer's figures; :mod:`autotune.training.state` finds them): bf16-true's parts, where it runs on the device and
    was not the precision counted; bitsandbytes' AdamW8bit state and torch.optim.Adafactor's (from their layouts),
    where smaller than the optimizer's; LoRA adapters of rank ADAPTER_RANK on the blocks' Linear layers."""

    true_parts: dict[str, int] | None = None  # bf16-true: weights, gradients, optimizer state
    eight_bit_bytes: int | None = None
    factored_bytes: int | None = None
    adapter_parameters: int = 0
    adapter_layers: int = 0
    parameters: int = 0  # the model's, which the adapters' share is of


class _SavedBytes:
    """Saved-tensor hooks that count what autograd saves, by storage, and by the block that saved it."""

    def __init__(self, model: nn.Module) -> None:
        self._skip = {_storage(t)[0] for t in (*model.parameters(), *model.buffers())}
        self._seen: set[int] = set()
        self.total = 0
        self.block: str | None = None
        self.by_block: dict[str, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage(tensor)
        if key not in self._skip and key not in self._seen:  # the graph holds the tensor: its storage stays unique
            self._seen.add(key)
            self.total += nbytes
            if self.block is not None:
                self.by_block[self.block] = self.by_block.get(self.block, 0) + nbytes
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """The tensor's storage (its StorageImpl, which views share; not its address, which a fake tensor's storage
    lacks) and bytes; a tensor without one (a subclass) counts as itself."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(tensor), tensor.numel() * tensor.element_size()


def _saved(model: nn.Module, run: Callable[[], Any], blocks: tuple[str, ...] = ()) -> _SavedBytes:
    """What one forward pass (``run``) saves for backward; with ``blocks``, also by block."""
    counter = _SavedBytes(model)
    handles = []
    for path in blocks:
        def enter(module: nn.Module, args: Any, path: str = path) -> None:
            counter.block = path

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            counter.block = None

        handles += [model.get_submodule(path).register_forward_pre_hook(enter),
                    model.get_submodule(path).register_forward_hook(leave)]
    try:
        with torch.enable_grad(), counter.hooks():
            run()  # the graph (and what it saved) is dropped with run's result
    finally:
        for handle in handles:
            handle.remove()
    return counter


def measure_floor(model: nn.Module, chain: Chain | None, run: Callable[[], Any]) -> Floor:
    """Measure :class:`Floor` for ``model`` as it is (real CPU tensors or fake ones), ``run()`` being one forward pass
    with its loss at batch 1 under the precision to measure. The model is left without a plan."""
    if chain is None:
        return Floor(_saved(model, run).total, 0, 0)
    plain = _saved(model, run, chain.blocks)
    apply_plan(model, "all", chain)
    try:
        kept = _saved(model, run).total
    finally:
        remove_plan(model)
    weights = max(sum(p.numel() * p.element_size() for p in model.get_submodule(path).parameters())
                  for path in chain.blocks)
    return Floor(kept, max(plain.by_block.values(), default=0), weights)


def state_levers(parts: dict[str, int], optimizer: str, guessed: bool, budget_bytes: int, headroom: float,
                 host_bytes: int | None, floor: Floor | str | None = None, *, shards: int = 1,
                 smaller: SmallerState | None = None) -> str:
    """One line: the state by part, against the budget, and what would fit (autotune.preparation's state check).
    ``shards``: the FSDP ranks the state is already sharded over (each holds 1/shards of it). ``smaller``: what the
    levers that shrink the state would leave of it (bf16-true, an 8-bit or factored optimizer, adapters).

    With ``floor`` measured, sharding needs room on each rank for its share of the state, the largest block's
    weights (gathered whole while it computes) and batch 1's activations; unmeasured (a string: why), it leaves
    at least a quarter of the usable budget to activations. Offloading the state leaves the device the
    activations and the weights of the block being computed.
    """
    usable = usable_bytes(budget_bytes, headroom)
    total = sum(parts.values())
    about = "about " if guessed else ""
    measured = floor if isinstance(floor, Floor) else None
    if measured is not None:
        room = usable - measured.activations - measured.block_weights
        step = (f"; batch 1 adds {format_bytes(measured.activations)} of activations with every block recomputed "
                f"(measured here at {measured.precision}: {format_bytes(measured.kept)} kept from forward to backward, "
                f"{format_bytes(measured.recompute)} for one block's recompute)")
    else:
        room = 0.75 * usable
        step = f" (activations not measured: {floor})" if isinstance(floor, str) else ""
    sharded = (f", {about}{format_bytes(total / shards)} on each of {shards} ranks sharded by FSDP2" if shards > 1
               else "")
    head = (f"nothing fits: training {'the' if not guessed else 'this'} model needs {about}{format_bytes(total)} "
            f"before any activation (weights {format_bytes(parts['weights'])}, gradients "
            f"{format_bytes(parts['gradients'])}, {optimizer} state {about}{format_bytes(parts['optimizer_state'])})"
            f"{sharded}, more than --budget {format_bytes(budget_bytes)} less {headroom:.0%} headroom "
            f"({format_bytes(usable)}){step}")
    if room <= 0:
        return (f"{head}; even without any state, batch 1's activations and one block's weights exceed the budget: "
                f"no sharding or state offload fits it; raise --budget")
    ranks = max(2, math.ceil(total / room))
    host = (f", {format_bytes(host_bytes)} available here" + ("" if host_bytes >= total else ", not enough")
            if host_bytes is not None else "")
    device = (f": {format_bytes(measured.activations + measured.block_weights)} at batch 1" if measured else "")
    return (f"{head}; it would fit sharded over {ranks} ranks (--parallel fsdp under torchrun --nproc-per-node "
            f"{ranks}: {format_bytes(total / ranks)} of state on each, {format_bytes(usable - total / ranks)} left for "
            f"the gathered block and activations; predict one rank first with --dry-run --parallel fsdp --world-size "
            f"{ranks}), or with the state in host memory (--parallel fsdp --offload state, "
            f"FSDP2's CPUOffloadPolicy, on one rank too: {format_bytes(total)} of host memory{host}; the device keeps the activations and the weights of "
            f"the block being computed{device})"
            f"{_smaller_state(parts, usable, optimizer, smaller, measured.activations if measured else None)}")


def _smaller_state(parts: dict[str, int], usable: float, optimizer: str, smaller: SmallerState | None,
                   batch_1: int | None = None) -> str:
    """The levers of :func:`state_levers` that shrink the state itself, each with what training would then need
    (against ``batch_1``, batch 1's activations with every block recomputed, where measured)."""
    weights_and_gradients = parts["weights"] + parts["gradients"]
    need = functools.partial(_need, usable=usable, batch_1=batch_1)
    levers = _state_levers(parts, need, optimizer, smaller) if smaller is not None else []
    if parts["optimizer_state"] and weights_and_gradients < usable:
        levers.append(f"SGD without momentum holds no state: the weights and gradients alone are "
                      f"{format_bytes(weights_and_gradients)}, leaving {format_bytes(usable - weights_and_gradients)} "
                      f"for the activations")
    elif parts["optimizer_state"]:
        levers.append(f"no optimizer alone makes it fit: the weights and gradients are "
                      f"{format_bytes(weights_and_gradients)} without any state")
    return f"; or less state: {'; '.join(levers)}" if levers else ""


def _need(total: float, usable: float, batch_1: int | None) -> str:
    """``total`` bytes of state against the usable budget, in words: what it leaves, and whether batch 1 fits in it."""
    if total >= usable:
        return f"{format_bytes(total)} in all, still over {format_bytes(usable)}"
    fits = ("" if batch_1 is None else f", batch 1's {format_bytes(batch_1)} " + (
        "among them" if total + batch_1 <= usable else "not"))
    return f"{format_bytes(total)} in all, leaving {format_bytes(usable - total)} for the activations{fits}"


def _state_levers(parts: dict[str, int], need: Callable[[float], str], optimizer: str,
                  smaller: SmallerState) -> list[str]:
    """bf16-true, an 8-bit and a factored optimizer, adapters: each lever's figure for the model (:class:`SmallerState`)."""
    levers = []
    true = smaller.true_parts
    if true is not None:
        levers.append(f"--precisions bf16-true holds the weights, gradients and {optimizer} state in bf16 (no fp32 "
                      f"master weights: updates below a weight's resolution are lost), {format_bytes(true['weights'])} "
                      f"+ {format_bytes(true['gradients'])} + {format_bytes(true['optimizer_state'])}: "
                      f"{need(sum(true.values()))}")
    held = parts["weights"] + parts["gradients"]
    if smaller.eight_bit_bytes is not None:
        both = (f"; with bf16-true, {need(true['weights'] + true['gradients'] + smaller.eight_bit_bytes)}"
                if true is not None else "")
        levers.append(f"--optimizer bitsandbytes.optim:AdamW8bit (pip install bitsandbytes, on CUDA), its moments in 8 "
                      f"bits with a float32 scale per block of {EIGHT_BIT_BLOCK}, from its layout: "
                      f"{format_bytes(smaller.eight_bit_bytes)} of state, {need(held + smaller.eight_bit_bytes)}"
                      f"{both}")
    if smaller.factored_bytes is not None:
        levers.append(f"--optimizer torch.optim:Adafactor (factored second moments, a row and a column per matrix, "
                      f"from its layout): {format_bytes(smaller.factored_bytes)} of state, "
                      f"{need(held + smaller.factored_bytes)}")
    if smaller.adapter_parameters:
        a = smaller.adapter_parameters
        share = a / smaller.parameters if smaller.parameters else 0.0
        levers.append(f"adapters (PEFT LoRA r={ADAPTER_RANK} on the {smaller.adapter_layers} Linear layers of the "
                      f"blocks: {a:,} trained parameters, {share:.2%} of the model's) freeze the weights: "
                      f"{format_bytes(parts['weights'])} frozen and 16 bytes an adapter parameter (its weight, gradient "
                      f"and AdamW's moments), {need(parts['weights'] + 16 * a)}")
    return levers

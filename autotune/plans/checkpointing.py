"""Gradient-checkpoint plans applied to a model: each chosen block recomputed on its own, exactly.

A plan (:mod:`autotune.plans` names them) picks some of the model's repeated blocks; in the
forward pass a picked block keeps only its inputs, and the backward pass runs it again to get its
activations back. The design is the one transformers, timm and torchtitan use, for the same
reason: **each block call is checkpointed on its own, with exactly the arguments of that call**
(non-reentrant :func:`torch.utils.checkpoint.checkpoint`). A model's loop may pass every block
its own mask, scale or position bias, and do anything between blocks (norms, residual sums,
collected hidden states, router logits); the recompute replays the one call it belongs to, so a
plan never changes what the model computes. Grouping several blocks into one recompute unit
would save one stored input per block but has to guess the later blocks' arguments: autotune
does not group.

**Blocks** are found in every ``nn.ModuleList``, ``nn.Sequential`` and ``nn.ModuleDict`` holding two or
more children of one type that is not a plain ``torch.nn`` layer, outermost first: a GPT's
``transformer.h``, T5's encoder *and* decoder blocks, a CNN's blocks across all its stages, torchtitan's
``layers`` (a ``ModuleDict`` keyed by layer number).
Their order is the order the forward pass runs them (the preflight records it), and plan names
count in that order.

**State.** The recompute pass runs inside a context (``context_fn``, shared with per-operation
policies) that puts back every buffer the block's forward changed, so BatchNorm's running
statistics and ``num_batches_tracked`` are updated once per step, as without a plan. Dropout
masks are replayed from the saved RNG state. Anything else a block reads that its model changes
between the forward and the backward pass cannot be replayed: the run-time check
(:mod:`autotune.execution.plan_check`) finds such plans and drops them. One such state is known and handled as its
library does: a transformers model's key/value cache is off in training while a plan recomputes
(:mod:`autotune.plans.cache`).

Plans set an instance ``forward`` on each picked block that wraps the forward it had (its class's,
or one set before: ``--fp32-modules``, accelerate's hooks), so module hooks stay outside the
recompute (they run once, as without a plan), parameters and ``state_dict`` keys are untouched,
and :func:`remove_plan` restores exactly what was there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from autotune.errors import AutotuneError, UsageError
from autotune.plans import cache, offload
from autotune.vocabulary import Plan
from autotune.plans.selective import make_policy

__all__ = ["Chain", "AppliedPlan", "find_chain", "order_chain", "apply_plan", "remove_plan", "restore_buffers",
           "selective_contexts"]

# The recompute contexts a block's checkpoint gets: a function of the block's call state returning
# (forward context, recompute context), as torch's ``context_fn`` does.
Contexts = Callable[["_Call"], "tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]"]


@dataclasses.dataclass(frozen=True)
class Chain:
    """The model's repeated blocks, in the order its forward pass runs them."""

    blocks: tuple[str, ...]  # dotted module paths
    containers: tuple[str, ...]  # the ModuleList / Sequential / ModuleDict paths holding them ("" is the model itself)
    block_types: tuple[str, ...]  # class names of the blocks
    ordered_by: str = "definition"  # "forward" once a forward pass has been traced

    @property
    def length(self) -> int:
        return len(self.blocks)

    def describe(self) -> str:
        """A short name for messages: ``transformer.h`` or ``encoder.block + decoder.block``."""
        return " + ".join(c or "the model" for c in self.containers)

    def to_dict(self) -> dict[str, Any]:
        return {"length": self.length, "containers": list(self.containers), "block_types": list(self.block_types),
                "blocks": list(self.blocks), "ordered_by": self.ordered_by}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Chain | None":
        """The chain of a report; ``None`` for reports of schema version 1 (one container, no block list)."""
        if not data or "blocks" not in data:
            return None
        return cls(tuple(data["blocks"]), tuple(data["containers"]), tuple(data["block_types"]),
                   data.get("ordered_by", "definition"))


@dataclasses.dataclass(frozen=True)
class AppliedPlan:
    """The checkpoint plan applied to a model, as reported in each trial's JSON."""

    name: str
    chain: Chain | None
    recomputed: tuple[int, ...] = ()  # indices into chain.blocks
    cache_off: tuple[str, ...] = ()  # the modules whose key/value cache is off in training (autotune.plans.cache)

    def to_dict(self) -> dict[str, Any]:
        data = {"name": self.name, "recomputed_blocks": list(self.recomputed),
                "chain_length": self.chain.length if self.chain else None}
        if self.cache_off:
            data["cache_off"] = list(self.cache_off)
        if Plan(self.name).offload_mode:  # what it keeps for the backward pass, or its state, waits on the host
            data["offload"] = str(Plan(self.name).offload_mode)
        selective = Plan(self.name).selective
        if selective:  # every block wrapped; inside each, the policy keeps part of the forward
            data["policy"] = selective.keeps
        return data


def _is_block_type(cls: type) -> bool:
    """A class that can be a block: not a container or layer of ``torch.nn`` itself."""
    return not cls.__module__.startswith("torch.nn.")


def _is_composite(module: nn.Module) -> bool:
    """A module made of others (``nn.TransformerEncoderLayer``, an ``nn.Sequential`` of layers), not a layer itself."""
    return next(module.children(), None) is not None


def find_chain(model: nn.Module) -> Chain | None:
    """Return the model's repeated blocks (in definition order), or ``None`` when it has none.

    Candidates are the children of ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` containers whose type
    appears at least twice in that container and is not a ``torch.nn`` layer. Candidates inside
    another candidate are left out (a block's own sub-blocks, a mixture of experts' experts).
    Of the rest, the type holding the most parameters is kept, with every other type holding at
    least a tenth as many (an encoder-decoder whose encoder and decoder layers differ).

    A model with no such block of its own classes may be built of ``torch.nn``'s: ``nn.Transformer``'s
    encoder and decoder layers, an ``nn.Sequential`` of ``nn.Sequential(nn.Linear, nn.GELU)``. Then the
    repeated ``torch.nn`` modules made of other modules are its blocks, by the same rules.
    """
    return _chain_of(model, lambda child: _is_block_type(type(child))) or _chain_of(model, _is_composite)


def _chain_of(model: nn.Module, can_be_block: Callable[[nn.Module], bool]) -> Chain | None:
    """:func:`find_chain` among the repeated children that ``can_be_block``."""
    candidates: dict[str, tuple[str, nn.Module]] = {}  # path -> (container path, module)
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            continue
        counts = collections.Counter(type(child) for child in module.children())
        for name, child in module.named_children():
            if counts[type(child)] >= 2 and can_be_block(child):
                candidates[f"{path}.{name}" if path else name] = (path, child)
    outer = {p: c for p, c in candidates.items()
             if not any(p.startswith(q + ".") for q in candidates if q != p)}
    if not outer:
        return None
    params: dict[type, int] = collections.Counter()
    for _, module in outer.values():
        params[type(module)] += sum(p.numel() for p in module.parameters())
    best = max(params.values())
    types = {t for t, n in params.items() if n >= best / 10}
    kept = [(p, c) for p, (c, m) in outer.items() if type(m) in types]
    if len(kept) < 2:
        return None
    return Chain(
        blocks=tuple(p for p, _ in kept),
        containers=tuple(dict.fromkeys(c for _, c in kept)),
        block_types=tuple(dict.fromkeys(type(model.get_submodule(p)).__name__ for p, _ in kept)),
    )


def order_chain(model: nn.Module, chain: Chain, run: Callable[[], Any]) -> Chain:
    """Return ``chain`` with its blocks in the order ``run()`` (a forward pass of ``model``) calls them.

    Blocks called more than once count at their first call; blocks never called go last.
    """
    first_call: dict[str, int] = {}
    handles = []
    for path in chain.blocks:
        def seen(module: nn.Module, args: Any, path: str = path) -> None:
            first_call.setdefault(path, len(first_call))
        handles.append(model.get_submodule(path).register_forward_pre_hook(seen))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    order = sorted(chain.blocks, key=lambda p: (first_call.get(p, len(chain.blocks)), chain.blocks.index(p)))
    return dataclasses.replace(chain, blocks=tuple(order), ordered_by="forward")


def apply_plan(model: nn.Module, plan: str | int, chain: Chain | None = None, *,
               contexts: Contexts | None = None, host_budget_bytes: int | None = None) -> AppliedPlan:
    """Apply checkpoint plan ``plan`` (a name of :mod:`autotune.plans`) to ``model`` in place.

    ``chain`` defaults to :func:`find_chain` (in definition order); the tuner passes the chain
    in forward order. ``contexts`` makes each call's (forward, recompute) contexts (default:
    :func:`restore_buffers`, and for a selective plan :func:`selective_contexts`: its per-operation
    policy inside the buffer restore). A plan ``PLAN+offload`` applies ``PLAN`` and the activation
    offload (:mod:`autotune.plans.offload`), whose host copies may hold ``host_budget_bytes`` at most.
    Returns what was done; ``0`` leaves the model unchanged.
    """
    name = Plan(plan)
    if name.state:  # the state's place is the wrapper's (FSDP2's CPUOffloadPolicy): the model gets the rest of the plan
        applied = apply_plan(model, name.without_state, chain, contexts=contexts, host_budget_bytes=host_budget_bytes)
        return dataclasses.replace(applied, name=name)
    if name.offload:
        applied = apply_plan(model, name.base, chain, contexts=contexts)
        offload.install(model, host_budget_bytes=host_budget_bytes)
        return dataclasses.replace(applied, name=name)
    if name.off:
        return AppliedPlan(name, chain)
    chain = chain if chain is not None else find_chain(model)
    if chain is None:
        raise UsageError(f"{type(model).__name__} has no repeated blocks to checkpoint: use --segments 0")
    name.fits(chain.length, chain.describe())
    indices = name.blocks(chain.length)
    blocks = [model.get_submodule(chain.blocks[i]) for i in indices]
    if any(block in _APPLIED for block in blocks):
        raise UsageError(f"{type(model).__name__} already has a checkpoint plan: call remove_plan(model) first")
    traced = None  # under torch.compile: torch's SAC contexts for a selective plan, none for a block plan
    if contexts is None:
        contexts = functools.partial(selective_contexts, name) if name.selective else restore_buffers
        traced = _traced_contexts(name) if name.selective else None
    for block in blocks:
        _Recompute(block, contexts, traced).install()
    return AppliedPlan(name, chain, indices, tuple(cache.turn_off(model)) if blocks else ())


def remove_plan(model: nn.Module) -> None:
    """Undo :func:`apply_plan` on every block of ``model``: each gets back the ``forward`` it had (the model too, where
    it offloaded its activations)."""
    cache.restore(model)
    for module in model.modules():
        offload.uninstall(module)
    for module in model.modules():
        wrapper = _APPLIED.get(module)
        if wrapper is not None:
            wrapper.uninstall()


_ABSENT = object()
_APPLIED: "weakref.WeakKeyDictionary[nn.Module, _Recompute]" = weakref.WeakKeyDictionary()
_CLASSES: dict[tuple[type, Any], type] = {}  # (block class, compiled context_fn) -> the class of its recomputed blocks


@functools.lru_cache(maxsize=None)
def _traced_contexts(name: str) -> Callable[[], Any]:
    """A selective plan's context_fn under torch.compile: torch's SAC contexts around its policy, one object per plan
    name, so that dynamo sees the same constant in every model the plan is applied to."""
    return functools.partial(create_selective_checkpoint_contexts, make_policy(name))


def _recomputed_class(cls: type, traced: Callable[[], Any] | None) -> type:
    """The class a picked block takes while a plan is applied: its own, with :func:`_checkpointed_forward`.

    A class, not an instance attribute: dynamo guards a module's instance ``forward`` by its identity, so every
    fresh model (each trial's) would compile again; a class it guards by type, the same for every model and trial.
    """
    key = (cls, traced)
    if key not in _CLASSES:
        _CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": _checkpointed_forward, "_autotune_base": cls, "_autotune_traced": traced,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[key]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a block a plan recomputes. Under torch.compile, dynamo traces the checkpoint into the graph
    (the partitioner recomputes inside the backward graph) with a context_fn it can hold as a constant: the buffer
    restore's, made per call around a :class:`_Call`, would break the graph and run the block eager. Compiled, a
    buffer's update is one mutation applied after the forward graph, which the recompute does not repeat: there is
    nothing to restore (the plan checks compare the compiled plan with the compiled step without it, buffers
    included). Eager, the block's :class:`_Recompute`."""
    cls = type(self)
    if torch.compiler.is_compiling() and torch.is_grad_enabled():
        function = functools.partial(cls._autotune_base.forward, self, **kwargs)
        if cls._autotune_traced is None:
            return checkpoint(function, *args, use_reentrant=False)
        return checkpoint(function, *args, use_reentrant=False, context_fn=cls._autotune_traced)
    return self.__dict__["_autotune_recompute"](*args, **kwargs)


class _Call:
    """One checkpointed call of a block: the buffers its forward pass changed, known once it returns.

    A buffer is changed when its forward updates it in place (its version counter moves) or puts
    a new tensor in its place (``self.calls = self.calls + 1``). Batch norm kernels update their
    running statistics without moving the version counter: those of every norm layer that tracks
    them in training mode count as changed.
    """

    def __init__(self, module: nn.Module) -> None:
        self.slots = [(m, name, b, b._version) for m in module.modules() for name, b in m._buffers.items()
                      if b is not None]
        self.stats = [b for m in module.modules() if isinstance(m, _NormBase) and m.training and m.track_running_stats
                      for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
        self.changed: list[torch.Tensor] = []  # updated in place
        self.replaced: list[tuple[nn.Module, str]] = []  # (module, buffer name) holding a new tensor

    def forward_done(self) -> None:
        changed = list(self.stats)
        for module, name, before, version in self.slots:
            if module._buffers.get(name) is not before:
                self.replaced.append((module, name))
            elif before._version != version:
                changed.append(before)
        self.changed = list({id(b): b for b in changed}.values())
        self.slots = self.stats = None  # type: ignore[assignment]


class _RestoreBuffers:
    """The recompute context: whatever the recompute does to the buffers the forward changed is undone."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.saved: list[torch.Tensor] = []
        self.held: list[tuple[nn.Module, str, Any]] = []

    def __enter__(self) -> None:
        self.saved = [b.detach().clone() for b in self.call.changed]
        self.held = [(module, name, module._buffers.get(name)) for module, name in self.call.replaced]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, value in zip(self.call.changed, self.saved):
                buffer.copy_(value)
        for module, name, value in self.held:
            module._buffers[name] = value
        self.saved, self.held = [], []


def restore_buffers(call: _Call) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The default contexts: nothing in the forward pass; the buffer restore in the recompute."""
    return contextlib.nullcontext(), _RestoreBuffers(call)


class _Both(contextlib.ExitStack):
    """Enter several context managers in order; exit them in reverse."""

    def __init__(self, *managers: contextlib.AbstractContextManager) -> None:
        super().__init__()
        self.managers = managers

    def __enter__(self) -> "_Both":
        super().__enter__()
        for manager in self.managers:
            self.enter_context(manager)
        return self


def selective_contexts(name: str, call: _Call) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A selective plan's contexts: its policy (torch's SAC) in both passes, inside the buffer restore."""
    forward, recompute = create_selective_checkpoint_contexts(make_policy(name))
    plain_forward, restore = restore_buffers(call)
    return _Both(plain_forward, forward), _Both(restore, recompute)


class _Recompute:
    """The forward of one picked block: every call checkpointed on its own, with its own arguments.

    It holds its block weakly: a plan adds no reference cycle, so a dropped model is freed at once.
    """

    def __init__(self, module: nn.Module, contexts: Contexts, traced: Callable[[], Any] | None = None) -> None:
        self.module = weakref.ref(module)
        self.contexts = contexts
        self.traced = traced  # under torch.compile: the context_fn dynamo traces (a selective plan's policy), or None
        self.previous = module.__dict__.get("forward", _ABSENT)  # an instance forward set before the plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module()
        base = getattr(type(module), "_autotune_base", type(module))  # the block's own class (see install)
        inner = self.previous if self.previous is not _ABSENT else base.forward.__get__(module)
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)  # nothing to recompute without a backward pass
        function = functools.partial(inner, **kwargs) if kwargs else inner
        if torch.compiler.is_compiling():  # an instance forward set before the plan: see _checkpointed_forward
            if self.traced is None:
                return checkpoint(function, *args, use_reentrant=False)
            return checkpoint(function, *args, use_reentrant=False, context_fn=self.traced)
        call = _Call(module)
        out = checkpoint(function, *args, use_reentrant=False, context_fn=functools.partial(self.contexts, call))
        call.forward_done()
        return out

    def install(self) -> None:
        """The block takes its recomputed class (:func:`_recomputed_class`); one with a forward of its own instance
        (set before the plan) gets this object as its forward instead."""
        module = self.module()
        if self.previous is _ABSENT:
            module.__dict__["_autotune_recompute"] = self
            module.__class__ = _recomputed_class(type(module), self.traced)
        else:
            module.forward = self
        _APPLIED[module] = self

    def uninstall(self) -> None:
        module = self.module()
        if self.previous is _ABSENT:
            # the class it took (a library may wrap its forward as the class is made: transformers' layers do)
            ours = type(module) in _CLASSES.values() and "forward" not in module.__dict__
        else:
            ours = module.__dict__.get("forward") is self
        if not ours:
            raise AutotuneError(
                f"cannot undo the checkpoint plan on a {type(module).__name__}: its forward was replaced after "
                f"the plan was applied; undo that first"
            )
        if self.previous is _ABSENT:
            module.__class__ = type(module)._autotune_base
            del module.__dict__["_autotune_recompute"]
        else:
            module.forward = self.previous
        del _APPLIED[module]

"""Stage 2: the model built once and run once: its size, its optimizer's state, its blocks, its library's switch.

Bad input fails here, before any trial; a training state that cannot fit the budget is told so with the levers that
would fit (:class:`~autotune.errors.StateDoesNotFit`), and when nothing fits, what batch 1 needs at least.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports

from autotune._log import logger
from autotune.device import autocast_type, available_ram_bytes
from autotune.errors import ForwardFailed, StateDoesNotFit, UsageError, first_line
from autotune.execution.predict import CANNOT_FAKE, fake_tensors
from autotune.plans.checkpointing import Chain, find_chain, order_chain
from autotune.plans.floor import Floor, SmallerState, measure_floor, state_levers
from autotune.preparation.target import Target
from autotune.records import usable_bytes
from autotune.thirdparty import library_checkpointing, training_caches
from autotune.training.optimizer import UNPRIMED_NOTICE, measure_optimizer
from autotune.training.precision import MODES, keep_in_fp32
from autotune.training.state import held_parts, smaller_state
from autotune.training.workload import Workload, move_model, to_device
from autotune.vocabulary import SIXTEEN_BIT, Offload, Parallel, PrecisionName, runs_where

__all__ = ["ModelFacts", "preflight", "floor_facts"]


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What building the model once and running one forward pass said about it."""

    model_class: str
    parameter_count: int
    parameter_bytes: int
    chain: Chain | None  # the repeated blocks, in forward order
    library_checkpointing: str | None  # the library's own per-layer checkpointing switch, if it has one
    optimizer_state_bytes: int | None = None  # the optimizer's state for these parameters (None: not measurable)
    unprimed: str | None = None  # why the optimizer could not be primed (autotune.training.optimizer)
    gradient_bytes: int | None = None  # the parameters that require gradients (None: all of them)
    optimizer: dict[str, Any] | None = None  # the optimizer made here: its class, settings and source (the report's)
    training_cache: tuple[str, ...] = ()  # modules whose key/value cache a recomputing plan turns off (plans.cache)
    trainable_parameter_count: int | None = None  # the parameters that require gradients (None: all of them)
    # A true precision searched (bf16-true): its weights, gradients and optimizer state (None: not measurable), held in
    # its dtype (autotune.training.state.held_parts)
    held: dict[str, dict[str, int | None]] = dataclasses.field(default_factory=dict)

    def state(self, precision: str | None = None) -> dict[str, int]:
        """What a step holds whatever the batch, by part: the weights (frozen ones too), the gradients of the
        parameters that train, and the optimizer's state (measured: an optimizer holds state for the parameters that
        train only; where it could not be, AdamW's two moments of those); in a true ``precision`` (bf16-true) all
        three held in its dtype, else the model's own (fp32: autocast keeps it)."""
        if precision in self.held:
            parts = self.held[precision]
            optimizer = parts["optimizer_state"]
            return {**parts, "optimizer_state": 2 * parts["gradients"] if optimizer is None else optimizer}
        gradients = self.parameter_bytes if self.gradient_bytes is None else self.gradient_bytes
        optimizer = 2 * gradients if self.optimizer_state_bytes is None else self.optimizer_state_bytes
        return {"weights": self.parameter_bytes, "gradients": gradients, "optimizer_state": optimizer}

    @property
    def fixed_bytes(self) -> int:
        """The sum of :meth:`state` with the model's own dtype: the one definition the search's memory line and the
        state check share (:meth:`fixed_bytes_of` a true precision's)."""
        return sum(self.state().values())

    def fixed_bytes_of(self, precision: str) -> int:
        """The sum of :meth:`state` in ``precision``."""
        return sum(self.state(precision).values())


def preflight(target: Target) -> ModelFacts:
    """Stage 2: build the model and run one forward pass: bad input fails here, before any trial.

    The model is dropped and its memory handed back (reference cycles collected first: every
    Hugging Face model and any model after ``--fp32-modules`` holds its weights in one) before the
    trials measure.
    """
    workload, device, batch_size = target.workload, target.here, min(target.searching.batch_sizes)
    model = workload.build_model()
    keep_in_fp32(model, target.trial_settings.guard.fp32_modules, autocast_type(device))  # --fp32-modules names the model lacks fail here
    params = list(model.parameters())
    facts = ModelFacts(type(model).__name__, sum(p.numel() for p in params),
                       sum(p.numel() * p.element_size() for p in params), find_chain(model), None,
                       gradient_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
                       trainable_parameter_count=sum(p.numel() for p in params if p.requires_grad),
                       training_cache=tuple(type(m).__name__ for m in training_caches(model)))
    del params
    try:
        # The optimizer's state is measured on the CPU, before the model goes to the device: a model whose state
        # does not fit is told so with figures, not met by an out-of-memory error in its first forward pass.
        measured = measure_optimizer(workload.optimizer, model, target.trial_settings.lr)
        held = {name: held_parts(model, workload.optimizer, target.trial_settings.lr, MODES[name].weight_dtype)
                for name in target.precisions if MODES[name].weight_dtype is not None}
        facts = dataclasses.replace(facts, optimizer_state_bytes=measured.state_bytes, held=held)
        # Closures over this frame's ``model``, not arguments: ``del model`` below then frees the model even while the
        # StateDoesNotFit raised through here, and its traceback's frames, live on in the caller
        _check_state_fits(facts, workload.optimizer.name, target,
                          lambda: _floor_of(workload, facts.chain, target.precisions, target.trial_settings.guard.fp32_modules,
                                            model),
                          lambda parts: smaller_state(model, facts.chain, workload.optimizer, target.trial_settings.lr,
                                                      parts, true_runs=PrecisionName.BF16_TRUE in runs_where(
                                                          target.backend.supported_precisions()),
                                                      true_searched=bool(held)))
        chain = _forward(model, workload, device, batch_size, facts)
        library = _library_switch(model)
    finally:
        del model
        target.backend.release()  # gc.collect, then the allocator's cache: nothing of the preflight stays
    if measured.why is not None:
        logger.warning(UNPRIMED_NOTICE.format(name=workload.optimizer.name, why=measured.why))
    return dataclasses.replace(facts, chain=chain, library_checkpointing=library, unprimed=measured.why,
                               optimizer=measured.described)


def _check_state_fits(facts: ModelFacts, optimizer: str, target: Target, floor: Callable[[], Floor],
                      smaller: Callable[[dict[str, int]], SmallerState] | None = None) -> None:
    """Raise :class:`StateDoesNotFit` when the training state alone exceeds the usable budget (no trial could fit),
    with the levers that would fit: FSDP ranks, the state offloaded to host memory, less state (bf16-true, an 8-bit or
    factored optimizer, adapters, no optimizer state). The state counted is the smallest of the searched precisions'.
    ``floor()`` measures the smallest plan's activations at batch 1, ``smaller(parts)`` the levers' figures (only then:
    they cost forward passes and twins)."""
    budget, searching = target.budget, target.searching
    # FSDP2 shards the state over its ranks: a torchrun job's, or those a dry run predicts (--world-size); DDP does not
    shards = ((target.job.world_size if target.job else searching.world_size or 1)
              if searching.parallel == Parallel.FSDP else 1)
    if budget.bytes is None:
        return
    least = min(target.precisions, key=facts.fixed_bytes_of, default=None)
    if facts.fixed_bytes_of(least) / shards < usable_bytes(budget.bytes, budget.headroom):
        return
    if any(Offload.STATE in mode for mode in searching.offload or ()):
        return  # the state is searched in host memory (+state plans): the device holds none of it
    guessed = facts.optimizer_state_bytes is None  # an optimizer that could not be primed: AdamW's moments guessed
    parts = facts.state(least)
    name = optimizer.rsplit(":", 1)[-1].rsplit(".", 1)[-1]  # torch.optim:AdamW -> AdamW
    try:
        measured: Floor | str = floor()
    except Exception as exc:  # noqa: BLE001 - the levers are still named, with the activations unmeasured
        measured = f"{type(exc).__name__}: {first_line(exc)}"
    raise StateDoesNotFit(state_levers(parts, name, guessed, budget.bytes, budget.headroom, available_ram_bytes(),
                                       measured, shards=shards, smaller=smaller(parts) if smaller else None),
                          parts, measured if isinstance(measured, Floor) else None)


def _floor_of(workload: Workload, chain: Chain | None, precisions: Sequence[str], fp32_modules: Sequence[str],
              model: nn.Module | None = None) -> Floor:
    """The smallest plan's activations at batch 1 (:mod:`autotune.plans.floor`), at the searched precision that saves
    the least (bf16 stands in for fp16: the same bytes, without fp16's slow CPU kernels).

    Measured with PyTorch's fake tensors (torch.compile's: shapes and dtypes, no memory, no arithmetic, so a large
    model's takes seconds) on a model built under them; where the model cannot build or run so (a shape that
    depends on values), on the CPU, on ``model`` or a build of it.
    """
    # bf16-fsdp's activations: bf16's bytes too
    half = PrecisionName.BF16 if set(SIXTEEN_BIT) & set(precisions) else PrecisionName.FP32
    if model is not None and is_fake(next(model.parameters(), None)):  # a dry run's model: fake already
        return _floor_measured(model, workload, chain, half, contextlib.nullcontext())
    try:
        mode = fake_tensors()  # the batch stays real: its own bytes are real, and its values known
        with mode:
            fake = workload.build_model()
            keep_in_fp32(fake, fp32_modules, "cpu")
        return _floor_measured(fake, workload, chain, half, mode)
    except Exception as exc:  # noqa: BLE001 - measured for real instead
        logger.info("batch 1's activations are measured on the CPU (fake tensors could not run the model: %s: %s)",
                    type(exc).__name__, first_line(exc))
    if model is None:
        model = workload.build_model()
        keep_in_fp32(model, fp32_modules, "cpu")
    return _floor_measured(model, workload, chain, half, contextlib.nullcontext())


def _floor_measured(model: nn.Module, workload: Workload, chain: Chain | None, half: str,
                    mode: contextlib.AbstractContextManager) -> Floor:
    batch = workload.make_batch(model, 1)
    with mode, MODES[half].autocast("cpu"):
        measured = measure_floor(model, chain, lambda: workload.loss(model, batch))
    return dataclasses.replace(measured, precision=half)


def floor_facts(target: Target, chain: Chain | None) -> dict[str, Any] | None:
    """When nothing fits: the smallest plan's activations at batch 1 (:func:`_floor_of`), as the report's
    ``workload.floor``; None where they cannot be measured (said in the log)."""
    try:
        floor = _floor_of(target.workload, chain, target.precisions, target.trial_settings.guard.fp32_modules)
    except Exception as exc:  # noqa: BLE001 - the answer is given without the figure
        logger.info("the activations at batch 1 could not be measured: %s: %s", type(exc).__name__, first_line(exc))
        return None
    finally:
        target.backend.release()
    return {**dataclasses.asdict(floor), "activations": floor.activations}


def _forward(model: nn.Module, workload: Workload, device: torch.device, batch_size: int, facts: ModelFacts) -> Chain | None:
    """One forward pass without gradients on a batch of ``batch_size``; return the chain in forward order."""
    try:
        move_model(model, device)
        batch = to_device(workload.make_batch(model, batch_size), device)
        with torch.no_grad():
            if facts.chain is None:
                workload.loss(model, batch)
                return None
            return order_chain(model, facts.chain, lambda: workload.loss(model, batch))  # which block runs when
    except (UsageError, *CANNOT_FAKE):  # bad input; a dry run's forward that fake tensors cannot run (dry_run.py)
        raise
    except Exception as exc:
        cause = f"{type(exc).__name__}: {first_line(exc)}"
        raise ForwardFailed(f"{facts.model_class} failed on a batch of {batch_size}: {cause} "
                            f"(check --data, --loss and the model's example_batch)", cause) from None


def _library_switch(model: nn.Module) -> str | None:
    """On this throwaway model: has its library a per-layer checkpointing switch of its own?"""
    try:
        return library_checkpointing(model)
    except Exception as exc:  # noqa: BLE001 - a switch that fails is one not compared with
        logger.info("the model's own checkpointing switch failed (%s: %s): not compared", type(exc).__name__,
                    first_line(exc))
        return None

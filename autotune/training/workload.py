"""What to train: a model factory, a source of batches and the rule that turns outputs into a loss.

The workload protocol, for models used with autotune:

* ``--model MODULE:ATTR`` names an ``nn.Module`` class or a factory returning a module;
  ``--model-kwargs`` (JSON) are passed to it. Every trial starts from a fresh model: built once
  per process and copied exactly (:meth:`Workload.warm`), or built again where it cannot be copied.
* Batches come from ``--data MODULE:ATTR``, a map-style ``Dataset`` (or a factory for one) whose
  items are ``(input, target)`` tuples or dicts, collated with ``default_collate``, or a
  ``DataLoader`` (or a factory for one), whose dataset and ``collate_fn`` are used; without
  ``--data``, from the model's own ``example_batch(batch_size)`` method, which returns one batch
  in the same forms.
* A batch ``(input, target)`` calls ``model(input)`` (``model(**input)`` for a dict input,
  ``model(*input)`` for a tuple); a dict batch calls ``model(**batch)``.
* The loss is the output itself when it is a scalar tensor, else its ``.loss`` attribute or
  ``"loss"`` key, else ``--loss MODULE:ATTR`` called as ``loss(output, target)`` (the dict batch
  is the target of a dict batch), else the model's own ``loss(output, target)`` method.
* ``--step MODULE:ATTR`` replaces the two rules above: ``step(model, batch)`` runs the forward
  pass and returns the scalar loss (several outputs, auxiliary losses, a teacher).
* ``--optimizer MODULE:ATTR`` (and ``--optimizer-kwargs``) is the optimizer every trial trains
  with (:mod:`autotune.training.optimizer`); AdamW without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from autotune.plans.checkpointing import Chain
from autotune.training.copies import RandomStates, copy_model, copyable
from autotune.training.data import ItemSizes, loader_notes, random_indices, scan_items, worst_indices
from autotune.training.optimizer import OptimizerSpec
from autotune.errors import AutotuneError, UsageError, first_line, is_oom
from autotune.device import on_host
from autotune.thirdparty import not_found

__all__ = ["Workload", "load_object", "dataset_of", "LoadedData", "to_device", "move_model", "parse_model_kwargs"]


def load_object(spec: str, *, flag: str) -> Any:
    """Import ``MODULE:ATTR`` (ATTR may be dotted) and return the attribute; ``flag`` names the option in errors."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag} {spec!r} must look like MODULE:ATTR, e.g. autotune.examples:TinyGPT")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own modules import from here
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"{flag} {spec!r}: {not_found(exc, module_name)}") from None
    except Exception as exc:
        raise UsageError(f"{flag} {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{flag} {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    return obj


@dataclasses.dataclass(frozen=True)
class Workload:
    """A training workload: builds fresh models and batches and computes the loss of a step."""

    model_factory: Callable[[], nn.Module]
    name: str  # how reports name the model, e.g. "autotune.examples:TinyGPT"
    dataset: Dataset | None = None  # where batches come from; None: the model's example_batch()
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    collate_fn: Callable[[list], Any] | None = None  # the user's, when --data gives a DataLoader
    chain: Chain | None = None  # the repeated blocks plans count in, in forward order (the tuner's preflight finds it)
    # Per batch size, the dataset indices of the worst batch (autotune.training.data); found on first use when not given.
    worst_batches: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    notes: tuple[str, ...] = ()  # what the data's form means for the limits (a loader's own sampler, say)
    _found: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)  # worst batches found here
    # The from_specs() arguments, so that a worker process can build the same workload again.
    spec: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    optimizer: OptimizerSpec = dataclasses.field(default_factory=OptimizerSpec)  # what every trial trains with
    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None  # --step: the forward pass and loss, the user's
    # The sizes of the dataset's items, scanned once (the tuner's): a batch size not in worst_batches (an exact limit's,
    # an evaluation batch's) is found from them without reading the data again
    items: ItemSizes | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_specs(
        cls,
        model: str | type | Callable[[], nn.Module],
        *,
        model_kwargs: str | dict | None = None,
        data: str | Dataset | Callable[[], Dataset] | None = None,
        loss: str | Callable | None = None,
        library_checkpointing: bool = False,
        chain: Chain | dict | None = None,
        worst_batches: Mapping[int, Sequence[int]] | None = None,
        optimizer: Any = None,
        optimizer_kwargs: str | dict | None = None,
        step: str | Callable | None = None,
    ) -> "Workload":
        """Build a workload from ``MODULE:ATTR`` strings (the CLI's flags) or the objects themselves.

        ``library_checkpointing`` builds every model with its library's own per-layer
        checkpointing turned on (see :func:`autotune.thirdparty.library_checkpointing`).
        ``chain`` is the model's blocks in forward order (a :class:`Chain` or its dict), as the
        tuner's preflight found them; without it, plans find the blocks in definition order.
        """
        name = model if isinstance(model, str) else getattr(model, "__qualname__", type(model).__name__)
        target = load_object(model, flag="--model") if isinstance(model, str) else model
        kwargs = parse_model_kwargs(model_kwargs)
        if isinstance(target, nn.Module):
            raise UsageError(f"--model {name!r} is a module instance: name its class or a function that builds it")
        if not callable(target):
            raise UsageError(f"--model {name!r} is a {type(target).__name__}, not an nn.Module class or a factory function")
        loaded = dataset_of(data)
        loss_fn = load_object(loss, flag="--loss") if isinstance(loss, str) else loss
        if loss_fn is not None and not callable(loss_fn):
            raise UsageError(f"--loss {loss!r} is not callable: name a function loss(output, target)")
        step_fn = load_object(step, flag="--step") if isinstance(step, str) else step
        if step_fn is not None and not callable(step_fn):
            raise UsageError(f"--step {step!r} is not callable: name a function step(model, batch) returning the loss")
        spec = {"model": model, "model_kwargs": model_kwargs, "data": data, "loss": loss}
        for key, value in (("optimizer", optimizer), ("optimizer_kwargs", optimizer_kwargs), ("step", step)):
            if value is not None:
                spec[key] = value
        factory = functools.partial(_call, target, "--model", name, **kwargs)
        if library_checkpointing:
            spec["library_checkpointing"] = True
            factory = functools.partial(_with_library_checkpointing, factory)
        if isinstance(chain, dict):
            chain = Chain.from_dict(chain)
        if chain is not None:
            spec["chain"] = chain.to_dict()
        worst = {int(b): tuple(v) for b, v in (worst_batches or {}).items()}
        if worst:
            spec["worst_batches"] = worst
        chosen = load_object(optimizer, flag="--optimizer") if isinstance(optimizer, str) else optimizer
        return cls(factory, name, loaded.dataset, loss_fn, loaded.collate_fn, chain, worst, loaded.notes, spec=spec,
                   optimizer=OptimizerSpec.resolve(chosen, optimizer_kwargs,
                                                   spelled=optimizer if isinstance(optimizer, str) else None),
                   step_fn=step_fn)

    def with_chain(self, chain: Chain | None) -> "Workload":
        """The same workload, with plans counting in ``chain`` (in worker processes too)."""
        spec = None if self.spec is None else {**self.spec, "chain": None if chain is None else chain.to_dict()}
        return dataclasses.replace(self, chain=chain, spec=spec)

    def with_worst_batches(self, worst: Mapping[int, Sequence[int]], items: ItemSizes | None = None) -> "Workload":
        """The same workload, with the worst batch of each size given (in worker processes too), and the sizes of the
        data's items they were found from (``items``: other sizes are found from them, in this process)."""
        worst = {int(b): tuple(v) for b, v in worst.items()}
        spec = None if self.spec is None else {**self.spec, "worst_batches": worst}
        return dataclasses.replace(self, worst_batches=worst, spec=spec, items=items or self.items)

    def build_model(self, seed: int | None = None) -> nn.Module:
        """Return a freshly built model (on the CPU, in training mode).

        With ``seed``: the model ``torch.manual_seed(seed)`` and a build give, with the random state
        left as that build leaves it (dropout's masks then follow as they would). After
        :meth:`warm`, it is an exact copy of the model built once, not a build.
        """
        if seed is not None and (template := self.kept_model(seed)) is not None:
            return copy_model(template).train()
        if seed is not None:
            torch.manual_seed(seed)
        model = self.model_factory()
        if not isinstance(model, nn.Module):
            raise UsageError(f"--model {self.name!r} built a {type(model).__name__}, not a torch.nn.Module")
        return model.train()

    def warm(self, seed: int) -> None:
        """Build the model for ``seed`` once and keep it (on the CPU) for :meth:`build_model` to copy.

        Called before a trial's meter starts, so that the kept model is not in its peak. A model that
        cannot be copied exactly (deep copy fails, or it was built on a device) is built each time.
        """
        key = ("model", seed)
        if key in self._found:
            return
        self._found[key] = None  # tried: a failure here is met again, and said, by the trial's own build
        with contextlib.suppress(Exception):
            template = self.build_model(seed)
            states = RandomStates.now()
            if all(map(on_host, (*template.parameters(), *template.buffers()))) and copyable(template):
                self._found[key] = (template, states)  # a model that cannot be copied is built every time

    def kept_model(self, seed: int) -> nn.Module | None:
        """The model :meth:`warm` kept for ``seed``, not a copy, the random state as its build left it; or None."""
        cached = self._found.get(("model", seed))
        if cached is not None:
            cached[1].restore()
            torch.cuda.manual_seed_all(seed)  # as the build's manual_seed left it (a build on the CPU draws none there)
        return None if cached is None else cached[0]

    def unwarmed(self) -> "Workload":
        """The same workload, building every model anew: a dry run's build under fake tensors cannot copy a model
        :meth:`warm` kept (its real tensors cannot be copied into fake ones). The data's worst batches found so far
        are kept."""
        fresh = dataclasses.replace(self)
        fresh._found.update((k, v) for k, v in self._found.items() if not (isinstance(k, tuple) and k[0] == "model"))
        return fresh

    def kept_tensors(self) -> list[torch.Tensor]:
        """The tensors this workload keeps between trials (the models :meth:`warm` built, their random states)."""
        kept: list[torch.Tensor] = []
        for key, value in self._found.items():
            if isinstance(key, tuple) and key[0] == "model" and value is not None:
                template, states = value
                kept += [*template.parameters(), *template.buffers(), states.torch_cpu]
        return kept

    def make_batch(self, model: nn.Module, batch_size: int) -> Any:
        """Return the batch of ``batch_size`` samples that memory is measured on (on the CPU).

        With a dataset: the worst batch of that size (:func:`autotune.training.data.worst_indices`), the
        largest the data can make; without one, the model's ``example_batch(batch_size)``.
        """
        if self.dataset is None:
            return self._example_batch(model, batch_size)
        self._check_size(batch_size)
        indices = self.worst_batches.get(batch_size)
        if indices is None:  # not found by the tuner: find it now, once per size (the data read once)
            if "items" not in self._found:
                self._found["items"] = self.items or scan_items(self.dataset)
            indices = self._found.setdefault(batch_size, tuple(worst_indices(self._found["items"], batch_size)))
        return self.collate([self.dataset[i] for i in indices])

    def sample_batch(self, model: nn.Module, batch_size: int, draw: int, *, seed: int = 0) -> Any:
        """Return the ``draw``-th random batch of ``batch_size`` samples, the same for every configuration.

        Steps are timed on these: representative of an epoch. Without a dataset, the example batch.
        """
        if self.dataset is None:
            return self._example_batch(model, batch_size)
        self._check_size(batch_size)
        return self.collate([self.dataset[i] for i in random_indices(len(self.dataset), batch_size, draw, seed=seed)])

    def collate(self, items: list) -> Any:
        """Collate items as the user's loader does (its ``collate_fn``, else ``default_collate``)."""
        return (self.collate_fn or default_collate)(items)

    def _check_size(self, batch_size: int) -> None:
        n = len(self.dataset)
        if batch_size > n:
            raise UsageError(f"--data has {n} items, fewer than the batch size {batch_size}: use smaller --batch-sizes")

    @staticmethod
    def _example_batch(model: nn.Module, batch_size: int) -> Any:
        example_batch = getattr(model, "example_batch", None)
        if not callable(example_batch):
            raise UsageError(
                f"{type(model).__name__} has no example_batch(batch_size) method: pass --data MODULE:ATTR with a dataset"
            )
        return example_batch(batch_size)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Run the forward pass on ``batch`` and return the scalar loss (the user's ``--step`` when given)."""
        if self.step_fn is not None:
            return self._user_step(model, batch)
        if isinstance(batch, Mapping):
            output, target = model(**batch), batch
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, target = batch
            if isinstance(inputs, Mapping):
                output = model(**inputs)
            elif isinstance(inputs, (tuple, list)):
                output = model(*inputs)
            else:
                output = model(inputs)
        elif isinstance(batch, torch.Tensor):
            output, target = model(batch), None
        else:
            raise UsageError(
                f"a batch is a {type(batch).__name__}: batches must be (input, target) tuples, dicts or tensors"
            )
        return self._loss_of(model, output, target)

    def _user_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        name = getattr(self.step_fn, "__qualname__", type(self.step_fn).__name__)
        loss = self.step_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise UsageError(f"--step {name} returned a {type(loss).__name__}"
                             f"{f' of shape {tuple(loss.shape)}' if isinstance(loss, torch.Tensor) else ''}, not the "
                             f"scalar loss tensor: return the loss that backward() is called on")
        return loss

    def _loss_of(self, model: nn.Module, output: Any, target: Any) -> torch.Tensor:
        if isinstance(output, torch.Tensor) and output.ndim == 0:
            return output
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None and self.loss_fn is not None:
            loss = self.loss_fn(output, target)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module  # the model's own loss method, under --parallel ddp
        if loss is None and callable(getattr(model, "loss", None)) and target is not None:
            loss = model.loss(output, target)
        if loss is None:
            raise UsageError(
                f"{type(model).__name__} returned a {type(output).__name__} with no loss: return a scalar, "
                f"an output with .loss, or pass --loss MODULE:ATTR (called as loss(output, target))"
            )
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise UsageError(f"the loss is a {type(loss).__name__} of shape {getattr(loss, 'shape', '?')}, not a scalar tensor")
        return loss


@dataclasses.dataclass(frozen=True)
class LoadedData:
    """A ``--data`` (or ``--eval-data``) value loaded: the map-style ``dataset`` (None: no data), its loader's
    ``collate_fn`` (None: torch's default) and what the loader's form means for the limits (``notes``)."""

    dataset: Dataset | None = None
    collate_fn: Callable[[list], Any] | None = None
    notes: tuple[str, ...] = ()


def dataset_of(data: Any, flag: str = "--data") -> LoadedData:
    """``flag``'s value (``MODULE:ATTR``, a Dataset or DataLoader, or a factory for one) as :class:`LoadedData`; bad input
    is one line naming ``flag``."""
    data_obj = load_object(data, flag=flag) if isinstance(data, str) else data
    if data_obj is None:
        return LoadedData()
    dataset = data_obj if isinstance(data_obj, (Dataset, DataLoader)) else _call(data_obj, flag, data)
    collate_fn, notes = None, ()
    if isinstance(dataset, DataLoader):  # a loader brings its collate_fn (padding, say)
        notes = loader_notes(dataset)
        dataset, collate_fn = dataset.dataset, dataset.collate_fn
    if isinstance(dataset, IterableDataset):
        raise UsageError(f"{flag} {data!r} is an IterableDataset: autotune needs a map-style Dataset (with "
                         f"__getitem__ and __len__) to find the worst batch and draw random ones")
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise UsageError(f"{flag} {data!r} gave a {type(dataset).__name__}, not a map-style Dataset (with __getitem__ and __len__)")
    if len(dataset) == 0:
        raise UsageError(f"{flag} {data!r} is an empty dataset")
    return LoadedData(dataset, collate_fn, notes)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in ``batch`` (nested tuples, lists, dicts) to ``device``."""
    return tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def move_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` unless every parameter and buffer is there already (a dry run's model, built under
    fake tensors: ``Module.to`` swaps fake parameters, which they refuse, even for a move to where they are)."""
    if any(t.device != device for t in (*model.parameters(), *model.buffers())):
        model.to(device)
    return model


def parse_model_kwargs(model_kwargs: str | dict | None) -> dict:
    """Return ``--model-kwargs`` (JSON text, a dict or None) as a dict."""
    if model_kwargs is None:
        return {}
    if isinstance(model_kwargs, dict):
        return model_kwargs
    def no_constants(name: str) -> Any:
        raise UsageError(f"--model-kwargs holds {name}: use finite numbers")

    try:
        kwargs = json.loads(model_kwargs, parse_constant=no_constants)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--model-kwargs is not valid JSON ({exc.msg} at character {exc.pos}): write e.g. '{{\"n_layer\": 4}}'") from None
    if not isinstance(kwargs, dict):
        raise UsageError("--model-kwargs must be a JSON object, e.g. '{\"n_layer\": 4}'")
    return kwargs


def _call(factory: Callable, flag: str, spec: Any, **kwargs: Any) -> Any:
    try:
        return factory(**kwargs)
    except TypeError as exc:
        params = _signature(factory)
        raise UsageError(f"{flag} {spec!r} could not be called with {kwargs or 'no arguments'}{params}: {exc}") from None
    except AutotuneError:
        raise
    except Exception as exc:
        if is_oom(exc):
            raise  # a model too big for the budget is an outcome, not bad input
        if torch._guards.detect_fake_mode() is not None:  # a dry run builds under fake tensors: shapes, no values
            raise UsageError(f"{flag} {spec!r} cannot be built under fake tensors, as a dry run builds it (no memory, "
                             f"no values): {type(exc).__name__}: {first_line(exc)}; run without --dry-run") from None
        raise UsageError(f"{flag} {spec!r} raised {type(exc).__name__} while building: {exc}") from None


def _with_library_checkpointing(factory: Callable[[], nn.Module]) -> nn.Module:
    from autotune.thirdparty import library_checkpointing

    model = factory()
    if library_checkpointing(model) is None:
        raise UsageError(f"{type(model).__name__} has no per-layer checkpointing of its library's own")
    return model


def _signature(factory: Callable) -> str:
    try:
        return f" (its signature is {inspect.signature(factory)})"
    except (TypeError, ValueError):
        return ""

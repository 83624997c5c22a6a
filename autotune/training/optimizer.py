"""The user's optimizer: how a trial makes it, how its state exists before the first metered step, its size.

``--optimizer MODULE:ATTR`` names an optimizer class (``torch.optim:SGD``) or a factory taking the
parameters; ``--optimizer-kwargs`` (JSON) are passed to it; the API also takes the class, a
factory or a ``functools.partial``. Without one, trials train with AdamW at ``TrialSettings.lr``.
The report names the optimizer made, not only the spec's name: the preflight makes it once on the model
(:func:`measure_optimizer`) and :meth:`OptimizerSpec.describe` gives its class, its settings and where it
came from (a trainer integration's factory says so: ``configure_optimizers``, ``TrainingArguments``).

**Priming.** An optimizer creates its state (AdamW's two moments, SGD's momentum buffer,
Adafactor's row and column factors) in its first step, so without priming the first step of a
trial peaks lower than every later one, and in fp16 a step the GradScaler skips creates none. A
step on zero gradients at learning rate 0 is not neutral for every optimizer (SGD's weight decay
fills its momentum buffer; Adafactor's relative step ignores the learning rate), so the state is
not made by stepping the user's optimizer at all. :func:`prime` makes, for each parameter, a twin:
the same optimizer class with that parameter's group settings, over a zero tensor of the
parameter's shape, and steps it once. The twin's state has the shapes, dtypes and devices the
real state will have; it is held as *ballast* until the real optimizer's first step begins (a
step pre-hook), where the real state takes its place. The user's optimizer is untouched: training
is bitwise that of a fresh optimizer. Where a twin cannot be made (a class whose constructor needs
more than a parameter group), :func:`prime` returns ``None`` and the trial's metered warm-up runs
until the optimizer holds state instead (:data:`UNPRIMED_NOTICE`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Iterable

import torch
from torch._subclasses.fake_tensor import is_fake  # private, and in every torch autotune supports
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from autotune.errors import AutotuneError, UsageError, first_line, is_oom

__all__ = ["OptimizerSpec", "prime", "state_bytes", "measure_state_bytes", "measure_optimizer", "class_name",
           "json_safe", "UNPRIMED_NOTICE"]

UNPRIMED_NOTICE = ("the optimizer {name} could not be primed by a twin ({why}): each trial's metered warm-up runs "
                   "until the optimizer holds state (the first steps the GradScaler does not skip), so the peak "
                   "includes it")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer trials train with: a class or a factory over the parameters, and its keyword arguments."""

    factory: Callable[..., torch.optim.Optimizer] | None = None  # None: AdamW at the trial's lr
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    name: str = "torch.optim:AdamW"  # stable across runs: the study's identity and the report name it

    @classmethod
    def resolve(cls, optimizer: Any = None, kwargs: str | dict | None = None, *,
                spelled: str | None = None) -> "OptimizerSpec":
        """``--optimizer`` (a class, a factory or a partial; loaded from ``spelled``, its ``MODULE:ATTR``) and
        ``--optimizer-kwargs`` (JSON text or a dict) as a spec."""
        parsed = _parse_kwargs(kwargs)
        if optimizer is None:
            if parsed:
                return cls(torch.optim.AdamW, parsed, _name(torch.optim.AdamW, parsed))
            return cls()
        factory = optimizer
        if isinstance(factory, torch.optim.Optimizer):
            raise UsageError(f"--optimizer {_name(factory, {})!r} is an optimizer instance: name its class or a "
                             f"function that makes one from the parameters")
        if not callable(factory):
            raise UsageError(f"--optimizer {spelled or _name(factory, {})!r} is a {type(factory).__name__}, not an "
                             f"optimizer class or a factory taking the parameters")
        return cls(factory, parsed, spelled if spelled and not parsed else _name(factory, parsed))

    def make(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters (``lr`` is used by the default AdamW only).

        A factory with a true ``takes_model`` attribute is given the model instead (to group the
        parameters by name, as a framework's trainer does).
        """
        params = list(model.parameters())
        if self.factory is None:
            return torch.optim.AdamW(params, lr=lr)
        try:
            made = self.factory(model if getattr(self.factory, "takes_model", False) else params, **self.kwargs)
        except AutotuneError:
            raise
        except Exception as exc:
            if is_oom(exc):
                raise
            raise UsageError(f"--optimizer {self.name} raised {type(exc).__name__} when made over the model's "
                             f"parameters: {first_line(exc)}") from None
        if not isinstance(made, torch.optim.Optimizer):
            raise UsageError(f"--optimizer {self.name} made a {type(made).__name__}, not a torch.optim.Optimizer")
        return made

    def to_dict(self) -> dict[str, Any]:
        """The spec's identity (a study's key holds it): its ``name`` and ``kwargs``, as every version wrote them."""
        return {"name": self.name, "kwargs": self.kwargs}

    @property
    def source(self) -> str:
        """Where the optimizer came from: ``default`` (AdamW: none was given), ``optimizer`` (``--optimizer`` and
        ``--optimizer-kwargs``, ``tune(optimizer=...)``), or what a factory says of itself in its ``source``
        (a trainer integration's: ``configure_optimizers``, ``TrainingArguments``, ...)."""
        if self.factory is None:
            return "default"
        return str(getattr(self.factory, "source", None) or "optimizer")

    def describe(self, made: torch.optim.Optimizer) -> dict[str, Any]:
        """What the report says of ``made``, an optimizer this spec made: ``class`` (``torch.optim.SGD``),
        ``settings`` (its constructor's, ``made.defaults``: lr, momentum, weight_decay, ..., JSON-safe),
        ``source`` (:attr:`source`), ``groups`` where it has more than one param group or a group trains with
        other settings (each group's parameter count and the settings that differ), and what the factory adds
        in its ``described`` attribute (a framework's scheduler)."""
        settings = {k: json_safe(v) for k, v in made.defaults.items() if k not in ("params", "param_names")}
        described: dict[str, Any] = {"class": class_name(type(made)), "settings": settings, "source": self.source}
        groups = [{"parameters": sum(p.numel() for p in group["params"]),
                   **{k: json_safe(group[k]) for k in settings if k in group and json_safe(group[k]) != settings[k]}}
                  for group in made.param_groups]
        if len(groups) > 1 or any(len(group) > 1 for group in groups):
            described["groups"] = groups
        return {**described, **(getattr(self.factory, "described", None) or {})}


def _parse_kwargs(kwargs: str | dict | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if isinstance(kwargs, dict):
        return dict(kwargs)
    try:
        parsed = json.loads(kwargs)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--optimizer-kwargs is not valid JSON ({exc.msg} at character {exc.pos}): write e.g. "
                         f"'{{\"momentum\": 0.9}}'") from None
    if not isinstance(parsed, dict):
        raise UsageError("--optimizer-kwargs must be a JSON object, e.g. '{\"momentum\": 0.9}'")
    return parsed


def _name(obj: Any, kwargs: dict[str, Any]) -> str:
    """``module:Qualname(key=value, ...)`` for a class, a function or a partial: the same in every run."""
    if isinstance(obj, functools.partial):
        kwargs = {**obj.keywords, **kwargs}
        args = ", ".join(map(repr, obj.args))
        inner = _name(obj.func, {})
        return f"{inner}({args}{', ' if args and kwargs else ''}{_kwargs_text(kwargs)})" if args or kwargs else inner
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", "") or ""
    if module.startswith("torch.optim."):
        module = "torch.optim"  # torch.optim.sgd:SGD is torch.optim:SGD
    name = f"{module}:{target.__qualname__}"
    return f"{name}({_kwargs_text(kwargs)})" if kwargs else name


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(kwargs.items()))


def class_name(cls: type) -> str:
    """A class as ``module.Qualname``, torch's optimizers by their public name: ``torch.optim.SGD``, not
    ``torch.optim.sgd.SGD``."""
    module = cls.__module__ or ""
    if module.startswith("torch.optim.") and getattr(torch.optim, cls.__name__, None) is cls:
        module = "torch.optim"
    return f"{module}.{cls.__qualname__}"


def json_safe(value: Any) -> Any:
    """``value`` as JSON holds it: numbers, strings, booleans and None as they are, tuples as lists, a one-element
    tensor as its number, a float that is not finite as its text (``"inf"``); anything else as its ``repr``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not is_fake(value):
            return json_safe(value.item())
        return f"tensor of shape {list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    return repr(value)


# -- priming: the state before the first step, without touching the optimizer ------------------------------------


def _tensors(state: Iterable[dict[str, Any]]) -> list[torch.Tensor]:
    return [t for s in state for t in s.values() if torch.is_tensor(t)]


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s memory on this rank: a DTensor's local shard (FSDP2), a wrapper subclass's
    inner tensors (torchao's quantized optimizer state: its codes and scales), else ``t``."""
    if hasattr(t, "to_local"):
        return _leaves(t.to_local())
    if is_traceable_wrapper_subclass(t) and not is_fake(t):
        names, _ = t.__tensor_flatten__()
        return [leaf for name in names for leaf in _leaves(getattr(t, name))]
    return [t]


def _storage_key(t: torch.Tensor) -> int:
    """``t``'s storage (its StorageImpl, which views share and fake tensors have), or ``t`` where it has none."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes ``tensors`` hold on this rank, each storage once (a tensor shared by several parameters' state, as
    bitsandbytes' quantization maps are, is counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        for leaf in _leaves(t):
            seen.setdefault(_storage_key(leaf), leaf.numel() * leaf.element_size())
    return sum(seen.values())


def _own_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` holds itself, for all its parameters (bitsandbytes' quantization maps,
    ``name2qmap``), one level into its attributes' dicts and lists; its state and parameter groups left out."""
    found = []
    for name, value in vars(optimizer).items():
        if name in ("state", "param_groups", "defaults"):
            continue
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        found += [t for t in inner if torch.is_tensor(t)]
    return found


def _twin_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: dict[str, Any],
                dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The state ``optimizer`` will keep for ``param`` (held in ``dtype`` where given: bf16-true's): a twin of the same
    class over a zero tensor, stepped once. Tensors the twin holds for all its parameters are left out: the optimizer
    has its own."""
    settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    with torch.no_grad():
        dummy = torch.nn.Parameter(torch.zeros_like(param, dtype=dtype or param.dtype))
        dummy.grad = dummy.detach()  # the same memory as the tensor: a twin adds one parameter's bytes at most
    twin = type(optimizer)([{**settings, "params": [dummy]}])
    twin.step()
    shared = {_storage_key(leaf) for t in _own_tensors(twin) for leaf in _leaves(t)}
    return [t for t in _tensors(twin.state.values()) if not {_storage_key(leaf) for leaf in _leaves(t)} & shared]


@dataclasses.dataclass(frozen=True)
class Primed:
    """The ballast that holds an optimizer's state-to-be (emptied as its first step begins), or none and the
    exception that kept a twin from being made (``failure``: the caller then warms up until the optimizer holds
    state)."""

    ballast: list[torch.Tensor]
    failure: Exception | None = None


def prime(optimizer: torch.optim.Optimizer, *, dtype: torch.dtype | None = None) -> Primed:
    """Hold the state ``optimizer`` will create, as ballast, until its first step begins (module docstring).
    ``dtype``: the state of parameters held in it instead of their own (what bf16-true's would hold; measuring)."""
    ballast: list[torch.Tensor] = []
    # A twin's state depends on its parameter's kind, shape, layout, dtype and device and on its group's settings
    # alone (a twin is a fresh tensor): parameters alike share one twin, their ballast made like its state
    twins: dict[tuple, list[torch.Tensor]] = {}
    try:
        for group in optimizer.param_groups:
            settings = repr(sorted((k, v) for k, v in group.items() if k not in ("params", "param_names")))
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                key = (type(param), tuple(param.shape), param.stride(), dtype or param.dtype, param.device, settings)
                if key in twins:  # a subclass's state (torchao's) as the plain tensors that hold its memory
                    ballast.extend(torch.empty_like(leaf) for t in twins[key] for leaf in _leaves(t))
                else:
                    twins[key] = _twin_state(optimizer, param, group, dtype)
                    ballast.extend(twins[key])
    except Exception as exc:  # noqa: BLE001 - a class that cannot be rebuilt for one parameter: said, not fatal
        if is_oom(exc):
            raise
        return Primed([], exc)

    def drop(*_: Any) -> None:
        ballast.clear()  # the real state is made in this step: the ballast stood in for it until now
        handle.remove()

    handle = optimizer.register_step_pre_hook(drop)
    return Primed(ballast)


@dataclasses.dataclass(frozen=True)
class StateMeasured:
    """An optimizer's state measured for a model: its bytes, or None and why it could not be measured (``why``),
    and what the report says of the optimizer made (``described``: :meth:`OptimizerSpec.describe`)."""

    state_bytes: int | None
    why: str | None
    described: dict[str, Any]


def measure_state_bytes(spec: OptimizerSpec, model: torch.nn.Module, lr: float, *,
                        dtype: torch.dtype | None = None) -> int | None:
    """The bytes of the optimizer's state for ``model``'s parameters (twins, as :func:`prime` makes them, and the
    tensors the optimizer holds for all of them), or None where it could not be measured (:func:`measure_optimizer`
    says why). ``dtype``: with the parameters held in it (bf16-true's state), not in their own."""
    return measure_optimizer(spec, model, lr, dtype=dtype).state_bytes


def measure_optimizer(spec: OptimizerSpec, model: torch.nn.Module, lr: float, *,
                      dtype: torch.dtype | None = None) -> StateMeasured:
    """The optimizer's state for ``model`` (:func:`measure_state_bytes`), why it could not be measured, and what the
    report says of the optimizer made (the one the user's code built, not what its name says)."""
    optimizer = spec.make(model, lr)
    described = spec.describe(optimizer)
    primed = prime(optimizer, dtype=dtype)
    if primed.failure is not None:
        return StateMeasured(None, f"{type(primed.failure).__name__}: {first_line(primed.failure)}", described)
    try:
        return StateMeasured(state_bytes([*primed.ballast, *_own_tensors(optimizer)]), None, described)
    finally:
        primed.ballast.clear()
        del optimizer

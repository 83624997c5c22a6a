"""Fake tensors that know what the data alone decides: a prediction takes the branch the real step takes.

A fake tensor has a shape and no value, so a step whose path depends on a value cannot take it under fake tensors:
``bool(mask.all())`` raises, and libraries that test for fake tensors take the branch they take while tracing.
Hugging Face transformers does: under fake tensors it builds the attention mask that the real step skips where no
token is padded, so SDPA runs another kernel than the real step (on the CPU, one that keeps a score tensor per head
for backward): a small Llama's prediction was 2 MiB a sample over its measurement (issue 45).

What the data alone decides is known, though: the batch is real, and so is everything computed from it and from
constants only (a padding mask's ``all()``, ``labels != -100``, ``arange`` positions). :class:`KnowingFakeTensorMode`
keeps, beside each such fake tensor, a real tensor holding its value (computed on the CPU, at most
:data:`KNOWN_NUMEL` elements; the weights are fake, so nothing computed from them is known), and answers from it
where fake tensors cannot: a value read (``.item()``, a branch on a tensor) and an output whose shape depends on
values (``nonzero``). Where a value is not known, it raises as fake tensors do, and the libraries' fake-tensor tests
(:data:`LIBRARY_TESTS`) say "tracing" as before.

The values are computed with PyTorch's own kernels on real tensors outside every mode, so the meter never counts
them; a tensor the prediction did not make (the batch's own) is never written: an op that would write one leaves
its value unknown instead.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["KnowingFakeTensorMode", "KNOWN_NUMEL", "LIBRARY_TESTS"]

# The largest tensor whose value is kept: a batch's masks and positions (64 x 8,192 tokens is 524,288), not an
# activation. A value is a real tensor on the host, for as long as its fake tensor lives.
KNOWN_NUMEL = 1 << 20

# Libraries' tests for fake tensors, answered as the real step would where the value is known: (module, function).
# transformers' ``is_tracing(tensor)`` calls ``is_fake_tensor``: it skips the causal mask (and with it the math
# kernel) only for a mask it can read.
LIBRARY_TESTS = (("transformers.utils.import_utils", "is_fake_tensor"),)

_VALUE_READS = (DataDependentOutputException, DynamicOutputShapeException)

_aten = torch.ops.aten
# Ops whose value does not depend on their tensor input's (its shape, dtype and device only)
_LIKE = frozenset((_aten.ones_like.default, _aten.zeros_like.default, _aten.full_like.default))
_SHAPED_LIKE = _LIKE | {_aten.new_ones.default, _aten.new_zeros.default, _aten.new_full.default}
# Ops whose outputs hold no defined value
_UNDEFINED = frozenset((_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
                        _aten.new_empty.default, _aten.new_empty_strided.default))


class KnowingFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose fake tensors computed from the data and constants alone carry their values.

    ``values`` maps a fake tensor to the real tensor holding its value; a fake tensor is absent where its value is
    not known (computed from a fake weight, drawn at random, larger than :data:`KNOWN_NUMEL`, or written by an op
    whose result is not known)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake tensor -> real tensor of its value
        self._unknown: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> True: written, value not known
        self._ours: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages of values made here (ours to write)
        self._met: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake copy -> weak reference to the real tensor met
        self._tests: list[tuple[Any, str, Callable]] = []  # library tests answered while the mode is on
        self._depth = 0
        self._knowing_real_inputs()

    def _knowing_real_inputs(self) -> None:
        """A real tensor met inside (the data's, a buffer's) is its fake copy's value, as long as it lives (held
        weakly: the converter's memo holds the copy as long as the real tensor lives). Not a parameter's: a value
        computed from a weight is an activation, not something the data decides."""
        converter = self.fake_tensor_converter
        copy = converter.from_real_tensor

        def from_real_tensor(fake_mode: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            fake = copy(fake_mode, t, *args, **kwargs)
            if (fake_mode is self and fake.constant is None and not t.requires_grad
                    and not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu"):
                self._met[fake] = weakref.ref(t)
            return fake

        converter.from_real_tensor = from_real_tensor

    # --- entering: the libraries' fake-tensor tests answered as the real step would -------------------------------

    def __enter__(self) -> "KnowingFakeTensorMode":
        entered = super().__enter__()
        self._depth += 1
        if self._depth == 1:
            self._answer_tests()
            self._tests.append((torch.nn.Module, "to", torch.nn.Module.to))
            torch.nn.Module.to = _converting_something(torch.nn.Module.to)
        return entered

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            for module, name, original in reversed(self._tests):
                setattr(module, name, original)
            self._tests.clear()
        super().__exit__(*exc)

    def _answer_tests(self) -> None:
        """Each library test of an imported module answers "not fake" for a fake tensor whose value is known."""
        answered = {(id(module), name) for module, name, _ in self._tests if module is not torch.nn.Module}
        for module_name, name in LIBRARY_TESTS:
            module = sys.modules.get(module_name)
            if module is None or (id(module), name) in answered or not callable(getattr(module, name, None)):
                continue
            original = getattr(module, name)

            def test(x: Any, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
                if isinstance(x, FakeTensor) and self.known(x) is not None:
                    return False
                return _original(x, *args, **kwargs)

            self._tests.append((module, name, original))
            setattr(module, name, test)

    # --- dispatch ---------------------------------------------------------------------------------------------------

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._depth and len(self._tests) < len(LIBRARY_TESTS) + 1:  # + 1: Module.to's
            self._answer_tests()  # a library imported inside the mode (a model's factory imports transformers)
        try:
            out = super().dispatch(func, types, args, kwargs)
        except _VALUE_READS:
            real = self._real(args, kwargs)
            if real is None:
                raise
            return self._from_value(func, real)
        self._follow(func, args, kwargs, out)
        return out

    def known(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real tensor holding ``t``'s value, or None where it is not known."""
        if not isinstance(t, FakeTensor):
            return t  # a real tensor met inside (the batch's, a constant): its own value
        if t.constant is not None:
            return t.constant
        value = self.values.get(t)
        if value is None:
            met = self._met.get(t)
            value = met() if met is not None else None
        if value is None or t.untyped_storage() in self._unknown:
            return None
        return value

    def _real(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """``(args, kwargs)`` with every tensor replaced by its value, or None where one is not known."""
        flat, spec = tree_flatten((args, kwargs))
        real = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                a = self.known(a)
                if a is None or a.device.type != "cpu":
                    return None
            real.append(a)
        return tree_unflatten(real, spec)

    def _follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Keep the values of ``func``'s outputs where its inputs' are known; where it writes a tensor whose new value
        is not known, forget that storage's."""
        written = _written(func, args, kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
        if not outs and not written:
            return
        real = None
        if (func not in _UNDEFINED and torch.Tag.nondeterministic_seeded not in func.tags
                and all(t.numel() <= KNOWN_NUMEL and t.device.type == "cpu" for t in outs)
                and all(self._ours_to_write(t) for t in written)):
            real = self._real(args, kwargs) if func not in _SHAPED_LIKE else _shaped(func, args, kwargs)
        if real is None:
            for t in written:
                if isinstance(t, FakeTensor):
                    self.values.pop(t, None)
                    self._unknown[t.untyped_storage()] = True
            return
        value = _run(func, real)
        for fake, v in zip(tree_leaves(out), tree_leaves(value)):
            if isinstance(fake, FakeTensor) and isinstance(v, torch.Tensor):
                self.values[fake] = v
                if not func.is_view:
                    self._ours[v.untyped_storage()] = True

    def _ours_to_write(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s value is known and was made here (a real tensor of the user's is never written)."""
        value = self.known(t)
        return value is not None and value.untyped_storage() in self._ours

    def _from_value(self, func: Any, real: tuple[Any, Any]) -> Any:
        """What ``func`` returns where fake tensors cannot say: its value read (a number), or fake outputs of the
        shapes the values give (``nonzero``), their values kept."""
        value = _run(func, real)
        if not isinstance(value, torch.Tensor) and not any(isinstance(v, torch.Tensor) for v in tree_leaves(value)):
            return value
        flat, spec = tree_flatten(value)
        fakes = []
        for v in flat:
            if isinstance(v, torch.Tensor):
                fake = self.fake_tensor_converter.from_real_tensor(self, v.clone())
                self.values[fake] = v
                self._ours[v.untyped_storage()] = True
                v = fake
            fakes.append(v)
        return tree_unflatten(fakes, spec)


def _run(func: Any, real: tuple[Any, Any]) -> Any:
    """``func`` on real tensors, as the step's kernel runs it: no gradient, no autocast (the op reached here is the
    one autocast chose)."""
    args, kwargs = real
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        return func(*args, **kwargs)


def _shaped(func: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    """``(args, kwargs)`` of an op that reads only its tensor input's shape, dtype and device, the tensor replaced by
    an uninitialised real one like it: of its shape for a ``*_like`` op (whose output, as large, is held to
    :data:`KNOWN_NUMEL`), empty for a ``new_*`` op."""
    t = args[0] if args else None
    if not isinstance(t, FakeTensor):
        return args, kwargs
    if t.device.type != "cpu" or t.requires_grad:
        return None  # like a weight (an optimizer's zeroed state): what the data decides starts from no weight
    like = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) if func in _LIKE
            else torch.empty(0, dtype=t.dtype))
    return (like, *args[1:]), kwargs


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """The tensors ``func`` writes (its schema's mutable arguments, ``out=`` included), fake or real."""
    written: list[torch.Tensor] = []
    for i, name, kwarg_only in _write_positions(func):
        value = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


@functools.lru_cache(maxsize=None)
def _write_positions(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """Where ``func``'s schema has arguments it writes: (position, name, keyword-only), looked up once per op."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _converting_something(to: Callable) -> Callable:
    """``nn.Module.to`` that returns a module of fake tensors as it is where the call converts none of them.

    torch 2.13's ``Module._apply`` swaps each fake parameter for its converted self (``swap_tensors``), which refuses a
    tensor the fake tensors' converter holds a weak reference to: every one. So a ``to()`` under fake tensors failed
    even where it changed nothing, and a model whose build calls one could not be built so: PEFT moves each adapter to
    its base layer's device and dtype, which are already its own (a dry run then built the model for real once).
    """

    def converting(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if memory_format is None and tensors and all(
                isinstance(t, FakeTensor) and (device is None or t.device == device)
                and (dtype is None or t.dtype == dtype or not (t.is_floating_point() or t.is_complex()))
                for t in tensors):
            return module
        return to(module, *args, **kwargs)

    return converting

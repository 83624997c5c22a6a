"""Activation offload: what a plan keeps for the backward pass waits in host memory in between.

A plan ``PLAN+offload`` (``--offload activations``) runs the model's forward pass inside saved-tensor
hooks (:func:`torch.autograd.graph.saved_tensors_hooks`). Every tensor autograd saves for the
backward pass outside a recomputed block (the saved tensors of blocks the plan does not
recompute, and of whatever runs between blocks), and every input a recomputed block keeps for
its recompute (non-reentrant checkpointing saves them through the same hooks), is copied to host
memory as it is saved and copied back when the backward pass asks for it. Values are copied, not
converted: the step computes bitwise what the plan without offload computes (the plan check
verifies it, as for every plan).

Not moved: tensors under :data:`MIN_OFFLOAD_BYTES` (a copy's fixed cost outweighs them),
parameters, buffers and views of them (they stay on the device anyway: a copy would only add one; that
includes a parameter made during the forward pass, as FSDP2 gathers each block's unsharded ones), and
tensors whose layout a copy would not keep (overlapping or expanded strides), and subclasses. A
tensor saved twice is moved once. A tensor still alive elsewhere when the backward pass asks for
it (a batch the caller holds), and unchanged, is given back as it is: a copy back would sit
beside it on the device. What a selective plan keeps inside a block stays on the device
(its policy's cache, not a saved tensor); so do tensors saved by the loss outside the model's forward.

**CUDA.** Host copies live in pinned memory (PyTorch's caching host allocator). Both directions
run on a side stream, so the transfers overlap compute: a saved tensor's copy starts once the
compute stream has produced it, and its device memory is not reused before the copy has read it
(``record_stream``). In the backward pass, each copy back also starts the copies back of the
:data:`PREFETCH` tensors saved just before it, which the backward pass needs next.

**CPU.** Device and host are one memory, so offloading saves nothing real there; it is emulated
so that every machine exercises it. The host copy is made outside autotune's tensor meter (it is
host memory, not the device's), the copy back inside it (device memory again). A step's time then
includes a memory copy where a GPU would transfer over PCIe: it understates offload's cost.

**Host memory** is counted and bounded per model: ``host_peak_bytes`` is the most the host copies
held at once; past ``host_budget_bytes`` a copy is refused with :class:`HostBudgetExceededError`, an
out-of-memory error of the host (the peak then says what was asked for: a lower bound on the need).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from autotune.errors import AutotuneError
from autotune.meters.tensor import _PLAIN, plain_tensors
from autotune.units import format_bytes

__all__ = ["Offloader", "HostBudgetExceededError", "install", "uninstall", "offloader_of", "MIN_OFFLOAD_BYTES",
           "PREFETCH"]

MIN_OFFLOAD_BYTES = 64 * 1024  # smaller saved tensors stay on the device
PREFETCH = 2  # each copy back in the backward pass also starts this many of the next ones


class HostBudgetExceededError(torch.OutOfMemoryError):
    """Offloaded tensors would hold more host memory than the host budget (``--host-budget``): the host's out-of-memory.

    A ``torch.OutOfMemoryError``, so every handler treats it as one; its message says it is the host's.
    """

    def __init__(self, requested_bytes: int, held_bytes: int, budget_bytes: int, *,
                 what: str = "activation offload") -> None:
        super().__init__(
            f"host memory: {what} tried to hold {format_bytes(held_bytes + requested_bytes)} in host "
            f"memory, over the host budget of {format_bytes(budget_bytes)} (--host-budget)")
        self.requested_bytes, self.held_bytes, self.budget_bytes = requested_bytes, held_bytes, budget_bytes


class _Packed:
    """One saved tensor in host memory; ``back`` is its copy on the device once one was started."""

    __slots__ = ("host", "device", "nbytes", "back", "ready", "previous", "original", "version", "given",
                 "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int, previous: "_Packed | None",
                 original: torch.Tensor) -> None:
        self.host, self.device, self.nbytes = host, device, nbytes
        self.original = weakref.ref(original)  # alive still when unpacked (held elsewhere): no copy back is needed
        self.version = original._version
        self.back: torch.Tensor | None = None
        self.ready: Any = None  # CUDA: the event after which ``back`` (or, before it, ``host``) is complete
        self.previous = weakref.ref(previous) if previous is not None else None  # saved just before this one
        self.given: weakref.ref | None = None  # the copy back the backward pass was given, while it lives


class Offloader:
    """The saved-tensor hooks of one model: moves, counts and bounds host copies (module docstring)."""

    def __init__(self, model: nn.Module, *, host_budget_bytes: int | None = None, min_bytes: int | None = None) -> None:
        self.model = weakref.ref(model)
        self.host_budget_bytes = host_budget_bytes
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        self.host_bytes = 0  # held now
        self.host_peak_bytes = 0
        self.moved = 0  # tensors copied to the host so far
        self.moved_bytes = 0  # their bytes (each copied back once, at most: the time model's transfers)
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its _Packed: saved twice, moved once
        self._last: weakref.ref | None = None  # the tensor saved last (weakly: the graph holds what it saved)
        self._params: set[int] = set()
        self._stream: Any = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for one forward pass (the parameters' and buffers' storages read again: a wrapper may have moved
        them; what an earlier pass moved is forgotten, so a tensor that lives on is not answered with an old copy)."""
        model = self.model()
        kept = plain_tensors([*model.parameters(), *model.buffers()] if model is not None else [])  # DTensors' shards
        self._params = {t.untyped_storage()._cdata for t in kept}  # StorageImpls: a fake tensor's has no data
        self._seen = WeakIdKeyDictionary()
        self._last = None
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # -- the hooks ---------------------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self._movable(tensor):
            return tensor
        known = self._seen.get(tensor)
        if known is not None and known.version == tensor._version:
            return known
        nbytes = tensor.numel() * tensor.element_size()
        if self.host_budget_bytes is not None and self.host_bytes + nbytes > self.host_budget_bytes:
            # As the tensor meter does for the device: the peak of a refused step is what it asked for, a lower bound
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes + nbytes)
            raise HostBudgetExceededError(nbytes, self.host_bytes, self.host_budget_bytes)
        with torch.no_grad():
            if tensor.is_cuda:
                host = self._to_host_cuda(tensor)
                if host is None:
                    return tensor
            else:  # the CPU's emulation: a host copy the tensor meter does not count
                with _disable_current_modes():
                    host = torch.empty_like(tensor)
                    if host.stride() != tensor.stride():
                        return tensor
                    host.copy_(tensor)
        packed = _Packed(host, tensor.device, nbytes, self._last() if self._last is not None else None, tensor)
        if tensor.is_cuda:
            packed.ready = self._stream.record_event()
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        self.moved += 1
        self.moved_bytes += nbytes
        weakref.finalize(packed, self._freed, nbytes)
        self._seen[tensor] = packed
        self._last = weakref.ref(packed)
        return packed

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        original = packed.original()
        if original is not None and original._version == packed.version:
            # Held elsewhere all along (a batch the caller keeps, an output the loss still uses): a copy back would
            # sit beside it on the device. Unchanged since it was saved, it is the value saved.
            packed.back = None
            return original
        given = packed.given() if packed.given is not None else None
        if given is not None:  # unpacked before (one saved tensor read by two backward functions), and still alive
            return given
        if packed.ready is None:  # the CPU's emulation (no event): the copy back is device memory, counted by the meter
            with torch.no_grad():
                tensor = packed.host.clone()
        else:
            tensor = self._back_on_cuda(packed)
        packed.given = weakref.ref(tensor)
        return tensor

    def _back_on_cuda(self, packed: _Packed) -> torch.Tensor:
        """The copy back (started now unless prefetched), once the compute stream has waited for it; then the
        prefetch of the tensors saved just before, which the backward pass needs next, unless they were given back
        already (the backward pass does not always unpack in the reverse order of saving) or live on anyway."""
        if packed.back is None:
            self._to_device_cuda(packed)
        stream = torch.cuda.current_stream(packed.device)
        stream.wait_event(packed.ready)
        tensor, packed.back = packed.back, None
        tensor.record_stream(stream)  # made on the side stream, used on this one
        ahead, count = packed.previous, 0
        while ahead is not None and count < PREFETCH:
            earlier = ahead()
            if earlier is None:
                break
            if earlier.back is None and earlier.given is None and earlier.original() is None:
                self._to_device_cuda(earlier)
            ahead, count = earlier.previous, count + 1
        return tensor

    # -- helpers -------------------------------------------------------------------------------------------------

    def _movable(self, tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._is_view() else None
        return (type(tensor) in _PLAIN and tensor.layout == torch.strided and tensor.device.type in ("cuda", "cpu")
                and tensor.numel() * tensor.element_size() >= self.min_bytes
                and not isinstance(base, nn.Parameter)  # a view of a parameter the model did not hold when the hooks
                # were made: FSDP2's unsharded parameters, registered as each block's forward begins
                and tensor.untyped_storage()._cdata not in self._params)

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host_cuda(self, tensor: torch.Tensor) -> torch.Tensor | None:
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        if host.stride() != tensor.stride():
            return None
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is made before it is read
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return host

    def _to_device_cuda(self, packed: _Packed) -> None:
        stream = self._side_stream(packed.device)
        with torch.cuda.stream(stream):  # after the copy to the host (the same stream)
            packed.back = torch.empty_like(packed.host, device=packed.device)
            packed.back.copy_(packed.host, non_blocking=True)
            packed.ready = stream.record_event()

    def _freed(self, nbytes: int) -> None:
        self.host_bytes -= nbytes


_ABSENT = object()
_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, _Forward]" = weakref.WeakKeyDictionary()


class _Forward:
    """The model's forward inside its offloader's hooks (an instance ``forward``, like a plan's block wrappers)."""

    def __init__(self, model: nn.Module, offloader: Offloader) -> None:
        self.model = weakref.ref(model)
        self.offloader = offloader
        self.previous = model.__dict__.get("forward", _ABSENT)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model()
        inner = self.previous if self.previous is not _ABSENT else type(model).forward.__get__(model)
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)  # nothing is saved for a backward pass
        with self.offloader.hooks():
            return inner(*args, **kwargs)


def install(model: nn.Module, *, host_budget_bytes: int | None = None) -> Offloader:
    """Offload what ``model``'s forward pass saves for backward (module docstring); return its :class:`Offloader`."""
    if model in _INSTALLED:
        raise AutotuneError(f"{type(model).__name__} already offloads its activations: call remove_plan(model) first")
    offloader = Offloader(model, host_budget_bytes=host_budget_bytes)
    forward = _Forward(model, offloader)
    model.forward = forward
    _INSTALLED[model] = forward
    return offloader


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` (nothing when ``model`` does not offload)."""
    forward = _INSTALLED.get(model)
    if forward is None:
        return
    if model.__dict__.get("forward") is not forward:
        raise AutotuneError(f"cannot undo the activation offload of a {type(model).__name__}: its forward was replaced "
                            f"after the plan was applied; undo that first")
    if forward.previous is _ABSENT:
        del model.forward
    else:
        model.forward = forward.previous
    del _INSTALLED[model]


def offloader_of(model: nn.Module) -> Offloader | None:
    """The offloader installed on ``model`` or any module in it, or None."""
    for module in model.modules():
        forward = _INSTALLED.get(module)
        if forward is not None:
            return forward.offloader
    return None

"""The training state in host memory (``PLAN+state``, ``--offload state``): FSDP2's ``CPUOffloadPolicy``, measured.

Under the policy FSDP2 keeps each rank's shards of the parameters, their gradients and the optimizer's
state on the CPU (pinned on CUDA) and the optimizer steps there; each block's parameters are copied to
the device for its all-gather and each gradient shard back after its reduce-scatter. The device holds
the gathered blocks, the activations and the reduce buffers, and no state. :class:`HostState` follows
one model under the policy:

* **host_bytes**: the most the state held in host memory, read after the wrap, the priming and each
  optimizer step: the shards of the parameters and gradients and the optimizer's tensors, each storage
  once. The optimizer step's own temporaries (AdamW's intermediates) are not in it.
* **the optimizer step's seconds**: the trial reports their share of its timed steps
  (``optimizer_step_share``). On CUDA the step is the CPU's work, so its wall time is its cost.
* **the host budget**: a state over it ends the step in :class:`HostBudgetExceededError`, an out-of-memory
  of the host; activation offload's copies (``PLAN+offload+state``) may hold what the state leaves of it.

**The CPU's emulation.** Device and host are one memory there, so autotune's tensor meter is told which
tensors are the host's: the model's build and wrap and the optimizer's primed ballast (:func:`built_on_host`: the device never
holds the whole model, since FSDP2 moves and shards one block at a time; the buffers it moved are
counted), each gradient shard as FSDP2 sets it (a post-accumulate-grad hook, which
FSDP2 runs after its copy to the host) and everything the optimizer's step makes (it runs outside the
meter).
The step time then has no transfer over PCIe in it, and no pinned copies: it understates the cost.
On CUDA none of this is installed (a gradient hook would make FSDP2's copy to the host synchronous).

The values trained are those of the step without the policy except for the optimizer's arithmetic,
which is the CPU's: bitwise on the CPU, equal to float rounding against a GPU's optimizer.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from autotune.meters.tensor import enter_device, kept_on_host, leave_device, meter_aside, passing_peak, plain_tensors
from autotune.plans.offload import HostBudgetExceededError, Offloader
from autotune.device import host_memory_apart, on_host

__all__ = ["HostState", "OnHost", "built_on_host", "offload_policy", "wrap_bytes"]


def offload_policy(device: torch.device) -> Any:
    """FSDP2's ``CPUOffloadPolicy`` for ``device`` (pinned host memory where the device is a GPU)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy
    return CPUOffloadPolicy(pin_memory=host_memory_apart(device))


class OnHost:
    """What :func:`built_on_host` learns from its caller: what the device holds after the wrap (the buffers FSDP2
    moved there), what the host keeps (the parameters' shards and the optimizer's primed state), and the most FSDP2's
    wrap put on the device at once (:func:`wrap_bytes`)."""

    def __init__(self) -> None:
        self.on_device: list[torch.Tensor] = []
        self.on_host: list[torch.Tensor] = []
        self.wrap_bytes = 0


@contextlib.contextmanager
def built_on_host(device: torch.device) -> Iterator[OnHost]:
    """Where a ``PLAN+state`` model is built and wrapped and its optimizer primed: on the host, from which FSDP2 moves
    one unit at a time to the device to shard it.

    On the CPU's emulation all of it runs outside the tensor meter, with every other mode in force (a dry run's fake
    tensors: a model of any size is built without its memory); then the meter counts what the device holds afterwards
    (``on_device``) and, as a peak that came and went, the wrap's own (``wrap_bytes``), and never what the host keeps
    (``on_host``). On CUDA it changes nothing: the model is built on the host there anyway, and the CUDA meter sees the
    wrap's device memory.
    """
    told = OnHost()
    if host_memory_apart(device):
        yield told
        return
    with meter_aside():
        yield told
    kept_on_host(told.on_host)
    enter_device(told.on_device)
    passing_peak(told.wrap_bytes)


def wrap_bytes(model: nn.Module, blocks: Iterable[str], world_size: int) -> int:
    """The most FSDP2's wrap under ``CPUOffloadPolicy`` puts on the device at once: each unit (a block, then the root's
    own parameters, the whole model where there are no blocks) is moved there whole and its padded shard made there
    before it goes to the host."""
    def size(module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    units = [size(model.get_submodule(path)) for path in blocks]
    largest = max([size(model) - sum(units), *units])
    return largest + -(-largest // world_size)


def _host_storage_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the distinct CPU storages of ``tensors`` (a DTensor's: its local shard's; non-tensors skipped),
    told apart by their StorageImpl, which views share (a dry run's fake tensors have no data pointer)."""
    storages = {}
    for t in plain_tensors(tensors):
        if on_host(t):
            storage = t.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


class HostState:
    """One model trained with its state in host memory (module docstring); ``emulated`` on the CPU.

    Made, it has read what the state holds (``host_bytes``); :meth:`install` holds it to the host budget and then
    wraps the optimizer's step (and on the CPU hooks each gradient); :meth:`close` undoes both.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ballast: list[torch.Tensor],
                 device: torch.device, *, host_budget_bytes: int | None = None,
                 activations: Offloader | None = None) -> None:
        self.model, self.optimizer, self.ballast = model, optimizer, ballast
        self.emulated = not host_memory_apart(device)
        self.host_budget_bytes, self.activations = host_budget_bytes, activations
        self.host_bytes = self.held()  # the most the state held
        self.step_seconds: list[float] = []  # per training step, the optimizer's (0 where a GradScaler skipped it)
        self._this_step = 0.0
        self._step: Any = None
        self._hooks: list[Any] = []

    def install(self) -> None:
        """Hold the state to the host budget; then time the optimizer's step (and on the CPU, tell the meter)."""
        self._check(self.host_bytes)
        if self.emulated:  # the model, its shards and the ballast were built on the host (built_on_host)
            self._hooks = [p.register_post_accumulate_grad_hook(_gradient_left) for p in self.model.parameters()
                           if p.requires_grad]
        self._step = self.optimizer.step
        self.optimizer.step = self.step

    def close(self) -> None:
        """Undo :meth:`install` and let the model, optimizer and state go (hooks and the wrapped step hold them)."""
        for hook in self._hooks:
            hook.remove()
        if self.optimizer is not None:
            self.optimizer.__dict__.pop("step", None)
        self._hooks, self._step, self.model, self.optimizer, self.ballast, self.activations = [], None, None, None, [], None

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The optimizer's step, timed; on the CPU outside the tensor meter (the host's work)."""
        start = time.perf_counter()
        with meter_aside() if self.emulated else contextlib.nullcontext():
            out = self._step(*args, **kwargs)
        self._this_step += time.perf_counter() - start
        held = self.held()
        self.host_bytes = max(self.host_bytes, held)
        self._check(held)
        return out

    def end_step(self) -> None:
        """A training step ended: record its optimizer's seconds (none where a GradScaler skipped the step)."""
        self.step_seconds.append(self._this_step)
        self._this_step = 0.0

    def held(self) -> int:
        """What the state holds in host memory now (module docstring)."""
        state = (v for s in self.optimizer.state.values() for v in s.values())
        params = list(self.model.parameters())
        return _host_storage_bytes([*params, *(p.grad for p in params), *state, *self.ballast])

    def _check(self, held: int) -> None:
        if self.host_budget_bytes is None:
            return
        if held > self.host_budget_bytes:
            raise HostBudgetExceededError(held, 0, self.host_budget_bytes, what="the state offload (--offload state)")
        if self.activations is not None:  # activation offload's copies get what the state leaves
            self.activations.host_budget_bytes = self.host_budget_bytes - held

    def step_share(self, step_times: list[float]) -> float | None:
        """The median share of ``step_times`` (the timed steps, the last ones) spent in the optimizer's step."""
        mine = self.step_seconds[-len(step_times):] if step_times else []
        if not step_times or len(mine) < len(step_times):
            return None
        return round(statistics.median(o / s for o, s in zip(mine, step_times) if s > 0), 4)


def _gradient_left(param: torch.Tensor) -> None:
    """The CPU's emulation: FSDP2 has set a gradient shard, in host memory under the policy."""
    if param.grad is not None:
        leave_device([param.grad])

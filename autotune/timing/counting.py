"""The work of a training step, op by op: FLOPs and bytes read and written, per phase.

:class:`WorkCounter` is a ``TorchDispatchMode``: it sees every aten op the step runs, on real tensors or on a dry
run's fake ones alike (a prediction and a measurement count with the same code), and records for each its phase, its
class (matmul, convolution, attention, a memory-bound op, a view, a collective), its dtype, its FLOPs (the formulas
of ``torch.utils.flop_counter``, which ``FlopCounterMode`` uses, and the same formula for the CPU's fused attention,
which its registry lacks) and the bytes of its tensor inputs and outputs (none for a view: it moves nothing).

The phase is read from autograd's state, not from the code that runs: inside the backward pass, an op that records
a graph (grad mode on) recomputes a checkpointed block's forward, any other is the backward's own; outside it, an
op under grad mode is the forward pass's, an op without it the optimizer step's (and what runs beside it without
grad: clipping, the scaler's unscale, zeroing the gradients). An offloading plan's copies to the host are made out of
every mode's sight; their bytes come from the offloader (``offload_bytes``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable

import torch
import torch.utils.flop_counter as flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["WorkCounter", "StepWork", "OpWork", "PHASES", "op_kind", "op_flops", "dtype_name"]

FORWARD, BACKWARD, RECOMPUTE, OPTIMIZER = "forward", "backward", "recompute", "optimizer"
PHASES = (FORWARD, BACKWARD, RECOMPUTE, OPTIMIZER)
MATMUL, CONV, CONV_BACKWARD, ATTENTION, MEMORY, VIEW, COLLECTIVE = (
    "matmul", "conv", "conv_backward", "attention", "memory", "view", "collective")

_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten._scaled_mm}
_CONVS = {_aten.convolution, _aten._convolution, _aten.convolution_overrideable, _aten._slow_conv2d_forward,
          getattr(_aten, "cudnn_convolution", _aten.convolution)}
# Ops that return a view or metadata of their input, moving no bytes (those not marked as views in their schema)
_ALIASES = {_aten._unsafe_view, _aten.alias, _aten.lift_fresh, _aten._reshape_alias, _aten.detach}
_CPU_ATTENTION = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_ATTENTION_BACKWARD = getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class OpWork:
    """``count`` ops alike: phase, class, dtype, FLOPs and bytes read and written, each."""

    phase: str
    kind: str
    dtype: str
    flops: int
    bytes: int
    count: int = 1
    name: str = ""  # the aten op ("mm", "convolution", "convolution.grouped": groups > 1): its efficiency is its own
    # the independent products a batched matmul holds (bmm, baddbmm: its batch): it runs at the rate of one of them, a
    # small GEMM's, not at the rate of one GEMM of all its FLOPs (attention's many head-sized products)
    matrices: int = 1


@dataclasses.dataclass(frozen=True)
class StepWork:
    """A step's work: its ops (alike ones merged), and the bytes an offloading plan copied to the host."""

    ops: tuple[OpWork, ...]
    offload_bytes: int = 0

    def totals(self) -> dict[str, dict[str, int]]:
        """Per phase: ``flops``, ``bytes`` and ``ops``."""
        out: dict[str, dict[str, int]] = {}
        for op in self.ops:
            row = out.setdefault(op.phase, {"flops": 0, "bytes": 0, "ops": 0})
            row["flops"] += op.flops * op.count
            row["bytes"] += op.bytes * op.count
            row["ops"] += op.count
        return out

    @property
    def flops(self) -> int:
        """Every op's FLOPs, every phase."""
        return sum(op.flops * op.count for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        return {"phases": self.totals(), "offload_bytes": self.offload_bytes}


def op_kind(func: Any) -> str:
    """The class of aten op ``func`` (an ``OpOverload``), as the time model prices it."""
    packet = func.overloadpacket
    namespace = getattr(func, "namespace", "")
    if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        return COLLECTIVE
    if packet in _MATMULS:
        return MATMUL
    if packet in _CONVS:
        return CONV
    if packet is _aten.convolution_backward:
        return CONV_BACKWARD
    if "attention" in packet.__name__:
        return ATTENTION
    if func.is_view or packet in _ALIASES:
        return VIEW
    return MEMORY


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """``func``'s FLOPs by ``torch.utils.flop_counter``'s formulas (0 for an op it has none for, as
    ``FlopCounterMode`` counts); the CPU's fused attention by the same formula as the GPUs'."""
    packet = func.overloadpacket
    formula = flop_counter.flop_registry.get(packet)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    if _CPU_ATTENTION is not None and packet is _CPU_ATTENTION:
        return int(flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    if _CPU_ATTENTION_BACKWARD is not None and packet is _CPU_ATTENTION_BACKWARD:
        return int(flop_counter.sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
    return 0


def _nbytes(tensors: Iterable[Any]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def dtype_name(dtype: torch.dtype) -> str:
    """The time model's name of a floating dtype (``fp32``, ``bf16``, ``fp16``: a number format, spelled as the
    precision modes are); fp32's for any other."""
    return _DTYPES.get(dtype, "fp32")


def _dtype(args: tuple) -> str:
    first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return dtype_name(first.dtype if first is not None else torch.float32)


def _name(func: Any, args: tuple, kind: str) -> str:
    """The op's name; a grouped convolution's (depthwise: a memory-bound kernel of its own) marked so."""
    name = str(func.overloadpacket.__name__)
    if kind in (CONV, CONV_BACKWARD):
        groups = args[9] if kind == CONV_BACKWARD else (args[8] if len(args) > 8 else 1)
        if isinstance(groups, int) and groups > 1:
            return f"{name}.grouped"
    return name


def _matrices(func: Any, args: tuple) -> int:
    """The independent matrix products of a batched matmul (``bmm``: its first operand's leading dimension;
    ``baddbmm``: its second's); 1 for any other op."""
    packet = func.overloadpacket
    operand = args[0] if packet is _aten.bmm else args[1] if packet is _aten.baddbmm else None
    if isinstance(operand, torch.Tensor) and operand.dim() == 3:
        return max(int(operand.shape[0]), 1)
    return 1


def op_work(func: Any, args: tuple, kwargs: dict, out: Any, phase: str = "") -> OpWork:
    """One call of aten op ``func`` (``args``, ``kwargs``, its ``out``) as the time model prices it: its class,
    dtype, FLOPs, the bytes it reads and writes (a collective's: what crosses the link, the buffer reduced or the
    whole gathered), its name and, for a batched matmul, its products. The counter's and the calibration's alike."""
    kind = op_kind(func)
    flops = op_flops(func, args, kwargs, out) if kind in (MATMUL, CONV, CONV_BACKWARD, ATTENTION) else 0
    if kind == COLLECTIVE:
        moved = max(_nbytes(tree_leaves((args, kwargs))), _nbytes(tree_leaves(out)))
    else:
        moved = 0 if kind == VIEW else _nbytes(tree_leaves((args, kwargs))) + _nbytes(tree_leaves(out))
    return OpWork(phase, kind, _dtype(args), flops, moved, 1, _name(func, args, kind),
                  _matrices(func, args) if kind == MATMUL else 1)


def _phase() -> str:
    if torch._C._current_graph_task_id() != -1:  # inside a backward pass
        return RECOMPUTE if torch.is_grad_enabled() else BACKWARD
    return FORWARD if torch.is_grad_enabled() else OPTIMIZER


class WorkCounter(TorchDispatchMode):
    """Counts every op run inside it (see the module's docstring); :meth:`work` gives what was counted."""

    def __init__(self) -> None:
        super().__init__()
        self._ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # a tensor's metadata asked for (fake tensors ask prim.device): no work
            return out
        self._ops[op_work(func, args, kwargs, out, _phase())] += 1  # alike ops merged: each OpWork of count 1
        return out

    def work(self, offload_bytes: int = 0) -> StepWork:
        """What was counted so far, with ``offload_bytes`` copied to the host (an offloading plan's)."""
        ops = tuple(dataclasses.replace(op, count=count)
                    for op, count in sorted(self._ops.items(), key=lambda item: dataclasses.astuple(item[0])))
        return StepWork(ops, offload_bytes)

"""CUDA's rules for a prediction made where no GPU is: ``--device cuda --dry-run`` on a CPU-only machine.

A fake CUDA tensor needs a GPU once autograd runs: on a CPU build of torch the engine aborts the process as it
makes the first gradient edge ("PyTorch is not linked with support for cuda devices"), and on a CUDA build without
a GPU backward raises ("hasPrimaryContext expects a valid device index"); both seen with torch 2.13 and 2.14. So
where this machine has no GPU, a CUDA prediction runs the trial on fake CPU tensors (as a CPU dry run does) with
CUDA's rules wherever they differ from the CPU's and change what is held:

- **autocast's op lists.** CUDA's differ from the CPU's: under CUDA's autocast a LayerNorm, a softmax, a
  ``pow`` or a loss runs in float32 and keeps float32 outputs, which the CPU's leaves in bf16 or fp16. For the
  prediction, each op this torch registers for CUDA's autocast gets CUDA's policy on the CPU's autocast key
  (:data:`CUDA_POLICIES`, read from ``aten/src/ATen/autocast_mode.cpp``), and each op only the CPU casts falls
  through, as on CUDA. The casts are autocast's own ``to``; what the policies cannot do in Python is the cache
  of weight casts, so an op that only CUDA casts down (``einsum``, ``mv``, an RNN cell) casts a weight again at
  each use where CUDA would cast it once per forward. The ops both lists cast down (``linear``, ``matmul``,
  convolutions, attention) keep the CPU's autocast, cache included.
- **what the caching allocator reserves**, from the trial's allocation trace by
  :mod:`autotune.meters.caching_allocator` (two cuBLAS workspaces first); the budget holds the reserved
  prediction, as CUDA's meter holds the reserved figure. The trace keeps the stream each storage was made on, and
  the allocator caches a block for its stream alone: FSDP2 selects its all-gather and reduce-scatter streams with
  its device's ``stream`` context, ``torch.cpu.stream`` where the prediction runs on the CPU, so its gathered
  blocks and reduced gradients are reserved on those streams as on a GPU;
- **what NVML adds**: the CUDA context, an assumption (:data:`~autotune.meters.caching_allocator.CUDA_CONTEXT_BYTES`);
- **the attention kernel**: ``scaled_dot_product_attention`` runs the kernel CUDA would choose for the planned
  GPU (flash, memory-efficient or math, :mod:`autotune.execution.cuda_attention`), not the CPU's; the report counts
  the calls by kernel (``search.cuda.attention``) and says what was assumed.
- **dropout's mask**: CUDA's ``dropout`` runs the fused ``native_dropout`` (``is_fused_kernel_acceptable`` in
  ``aten/src/ATen/native/Dropout.cpp``), which keeps a bool mask for backward, one byte an element; the CPU's
  multiplies by a noise tensor of the input's dtype and keeps that (four bytes an element in float32). A prediction
  takes CUDA's path (:func:`dropout_as_on_cuda`).

Where this machine has a GPU, a CUDA prediction runs on fake CUDA tensors instead, with CUDA's own autocast; the
allocator's model and the NVML assumption apply the same way. ``benchmarks/gpu_check.py`` compares both with
measurements.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import sys
import threading
import warnings
from typing import Any, Callable, Iterator

import torch

from autotune.execution.cuda_attention import ORDER_ASSUMED, cuda_attention_on_cpu
from autotune.meters.caching_allocator import (CUDA_CONTEXT_BYTES, AllocatorSettings, Replay, cublas_workspace_bytes,
                                               nvml_bytes, replay, workspace_trace)
from autotune.meters.base import MemoryReading
from autotune.units import format_bytes
from autotune.vocabulary import AutocastPolicy

__all__ = ["CUDA_POLICIES", "CudaRules", "CudaReading", "cuda_autocast_on_cpu", "optimizers_as_on_cuda", "dropout_as_on_cuda",
           "ASSUMED_CAPABILITY"]

_LOWER = ("_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
          "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
          "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
          "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
          "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
          "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
         "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
         "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
         "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
         "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
         "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
         "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
_FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname",
                       "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum",
                       "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
                       "sum", "sum.dim_IntList", "sum.dim_DimnameList")
_FP32_APPEND_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
                      "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype"}  # redispatched to the overload after
# CUDA casts an RNN's input, states and weights down in ``_cudnn_rnn`` (aten/src/ATen/native/cudnn/AutocastRNN.cpp),
# which only a CUDA build registers: the emulation casts them one level up, in the RNN's own op
_CUDA_BUILD_RNNS = ("lstm.input", "lstm.data", "gru.input", "gru.data", "rnn_tanh.input", "rnn_tanh.data",
                    "rnn_relu.input", "rnn_relu.data")
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
            "tensordot", "scatter_add")

# CUDA's autocast policy of each op (aten/src/ATen/autocast_mode.cpp, torch 2.4-2.13: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE, AT_FORALL_PROMOTE and the
# banned binary_cross_entropy), by the op's name and overload as the dispatcher names them without "aten::"
CUDA_POLICIES: dict[str, AutocastPolicy] = {
    **{name: AutocastPolicy.LOWER for name in _LOWER}, **{name: AutocastPolicy.FP32 for name in _FP32},
    **{name: AutocastPolicy.FP32_SET_OPT_DTYPE for name in _FP32_SET_OPT_DTYPE},
    **{name: AutocastPolicy.FP32_APPEND_DTYPE for name in _FP32_APPEND_DTYPE},
    **{name: AutocastPolicy.PROMOTE for name in _PROMOTE}, "binary_cross_entropy": AutocastPolicy.BANNED,
    "_cudnn_rnn": AutocastPolicy.LOWER, **{name: AutocastPolicy.LOWER for name in _CUDA_BUILD_RNNS}}

# The ops the CPU's autocast casts down as CUDA's does (its KERNEL_CPU lower_precision_fp list): their CPU kernels
# stay, with autocast's cache of weight casts
_CPU_LOWER = frozenset(("conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm",
                        "linear", "_convolution.deprecated", "matmul", "conv_tbc", "conv_transpose1d",
                        "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "scaled_dot_product_attention"))

# What a plan for a GPU not at hand assumes of it: compute capability 9.0 (Hopper), whose cuBLAS workspace is the
# largest torch takes (32 MiB a handle, against 8 MiB and 128 KiB before Hopper): the assumption that errs high
ASSUMED_CAPABILITY = (9, 0)

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_BANNED = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast (CUDA's autocast "
           "refuses them): use torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss")
_registering = threading.RLock()  # the rules are registered process-wide, one prediction at a time


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if _eligible(value):
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _widest(values: Any, lower: torch.dtype) -> torch.dtype:
    """autocast's ``promote_type``: float32 if any eligible tensor among ``values`` is, else the lower precision."""
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else (value,))]
    return torch.float32 if any(_eligible(v) and v.dtype == torch.float32 for v in flat) else lower


def _policy_kernel(name: str, policy: AutocastPolicy) -> Callable[..., Any]:
    """The kernel that applies CUDA's ``policy`` to the op ``name`` on the CPU's autocast key (autocast's own
    kernels exclude the autocast keys for what they call, and so does this): :data:`_APPLY`'s function of the
    policy, given the op (the dtype overload where the policy redispatches to it)."""
    packet, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet), overload or "default")
    # a Python kernel is called without the trailing arguments left at their defaults: the dtype overload has none
    defaults = [a.default_value for a in op._schema.arguments if not a.kwarg_only]
    if policy is AutocastPolicy.FP32_APPEND_DTYPE:
        op = getattr(getattr(torch.ops.aten, packet), _FP32_APPEND_DTYPE[name])
    apply = functools.partial(_APPLY[policy], op, defaults,
                              next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        lower = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return apply(lower, args, kwargs)

    return kernel


def _cast_all(op: Any, args: tuple, kwargs: dict, to: torch.dtype) -> Any:
    return op(*_cast(args, to), **{k: _cast(v, to) for k, v in kwargs.items()})


def _lower(op: Any, defaults: list, dtype_at: int | None, lower: torch.dtype, args: tuple, kwargs: dict) -> Any:
    return _cast_all(op, args, kwargs, lower)


def _fp32(op: Any, defaults: list, dtype_at: int | None, lower: torch.dtype, args: tuple, kwargs: dict) -> Any:
    return _cast_all(op, args, kwargs, torch.float32)


def _promote(op: Any, defaults: list, dtype_at: int | None, lower: torch.dtype, args: tuple, kwargs: dict) -> Any:
    return _cast_all(op, args, kwargs, _widest((*args, *kwargs.values()), lower))


def _fp32_append_dtype(op: Any, defaults: list, dtype_at: int | None, lower: torch.dtype, args: tuple,
                       kwargs: dict) -> Any:
    args = (*args, *defaults[len(args):])
    return op(*args, **kwargs, dtype=torch.float32 if _eligible(args[0]) else args[0].dtype)


def _fp32_set_opt_dtype(op: Any, defaults: list, dtype_at: int | None, lower: torch.dtype, args: tuple,
                        kwargs: dict) -> Any:
    if _eligible(args[0]):  # a dtype the caller gave stays
        if dtype_at is not None and len(args) > dtype_at:
            args = (*args[:dtype_at], args[dtype_at] or torch.float32, *args[dtype_at + 1:])
        else:
            kwargs = {**kwargs, "dtype": kwargs.get("dtype") or torch.float32}
    return op(*args, **kwargs)


def _banned(op: Any, defaults: list, dtype_at: int | None, lower: torch.dtype, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(_BANNED)


# Each policy's kernel body: (op, its defaults, the index of its dtype argument, the autocast dtype, args, kwargs)
_APPLY: dict[AutocastPolicy, Callable[..., Any]] = {
    AutocastPolicy.LOWER: _lower, AutocastPolicy.FP32: _fp32, AutocastPolicy.PROMOTE: _promote,
    AutocastPolicy.FP32_APPEND_DTYPE: _fp32_append_dtype, AutocastPolicy.FP32_SET_OPT_DTYPE: _fp32_set_opt_dtype,
    AutocastPolicy.BANNED: _banned}


def _registered(key: str) -> set[str]:
    """The aten ops this torch registers a kernel for on autocast's ``key`` (names without "aten::")."""
    return {name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


@contextlib.contextmanager
def cuda_autocast_on_cpu() -> Iterator[list[str]]:
    """CUDA's autocast policies on the CPU's autocast key inside the block (process-wide, put back after).

    Yields the ops this torch casts on CUDA whose policy :data:`CUDA_POLICIES` does not know (left as the CPU's).
    """
    cuda, cpu = _registered("AutocastCUDA"), _registered("AutocastCPU")
    unknown = sorted(cuda - set(CUDA_POLICIES))
    with _registering:
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
                for name in sorted(((cuda | set(_CUDA_BUILD_RNNS)) & set(CUDA_POLICIES)) - (cpu & _CPU_LOWER)):
                    lib.impl(name, _policy_kernel(name, CUDA_POLICIES[name]), "AutocastCPU")
                for name in sorted(cpu - cuda):
                    lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            yield unknown
        finally:
            lib._destroy()


def _as_on_cuda(params: list[Any], differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
    """``torch.optim.optimizer._default_to_fused_or_foreach`` as it answers for real CUDA parameters."""
    if torch.jit.is_scripting() or differentiable:
        return False, False
    fused = use_fused and all(p is None or torch.is_floating_point(p) for p in params)
    return fused, not fused


@contextlib.contextmanager
def optimizers_as_on_cuda() -> Iterator[None]:
    """Inside the block, torch.optim's optimizers left to their default implementation take CUDA's: ``foreach``,
    whose steps make their intermediates for all parameters at once (AdamW's square roots of the second moments:
    the size of the parameters), where fake tensors took the one-tensor-at-a-time loop (a fake or CPU parameter is
    no type ``foreach`` supports). Process-wide, put back after."""
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("torch.optim.") and callable(getattr(m, "_default_to_fused_or_foreach", None))]
    before = [(m, m._default_to_fused_or_foreach) for m in modules]
    with _registering:
        try:
            for module, _ in before:
                module._default_to_fused_or_foreach = _as_on_cuda
            yield
        finally:
            for module, original in before:
                module._default_to_fused_or_foreach = original


def _fused_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as CUDA runs it: ``native_dropout`` (a bool mask kept for backward) where its fused kernel
    takes the call (``0 < p < 1``), else what every device does (``_dropout_impl``): the input itself, or zeros."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    return torch.ops.aten.native_dropout(input, p, train)[0]


@contextlib.contextmanager
def dropout_as_on_cuda() -> Iterator[None]:
    """Inside the block, ``dropout`` on CPU tensors that record gradients takes CUDA's fused path (module docstring):
    a kernel on the CPU's autograd key, ahead of the composite one. Process-wide, put back after."""
    with _registering:
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
                lib.impl("dropout", _fused_dropout, "AutogradCPU")
            yield
        finally:
            lib._destroy()


@dataclasses.dataclass
class CudaFindings:
    """What predictions made under :class:`CudaRules` found to say, gathered as they run: the ops this torch casts
    on CUDA with a policy :data:`CUDA_POLICIES` does not know, and the attention kernels the calls ran."""

    unknown_ops: list[str] = dataclasses.field(default_factory=list)
    attention: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # SDPA calls by kernel


@dataclasses.dataclass(frozen=True)
class CudaReading:
    """A prediction's reading as CUDA's meter would give it, and the modelled allocator's out-of-memory line where it
    ran out within the budget though the tensors alone fit (``allocator_error``; None: it did not)."""

    reading: MemoryReading
    allocator_error: str | None = None


@dataclasses.dataclass(frozen=True)
class CudaRules:
    """How a prediction for CUDA is made and read (:mod:`autotune.execution.predict`): where its fake tensors live,
    the allocator's settings, the cuBLAS workspaces and CUDA context assumed. What the predictions find is kept
    apart, in a :class:`CudaFindings` they are given."""

    here: torch.device  # where the prediction's fake tensors live: cuda where this machine has a GPU, else the CPU
    fake_cuda: bool = False  # the fake tensors are CUDA's (a GPU is here): CUDA's own autocast applies
    allocator: AllocatorSettings = AllocatorSettings()
    capability: tuple[int, int] = ASSUMED_CAPABILITY
    context_bytes: int = CUDA_CONTEXT_BYTES
    described: tuple[bool, bool] = (False, False)  # the capability and the context given (--cuda-*), not assumed

    @classmethod
    def for_this_machine(cls, device: torch.device | None = None, *, capability: tuple[int, int] | None = None,
                         context_bytes: int | None = None) -> "CudaRules":
        """Fake CUDA tensors where this machine has a GPU (``device``'s capability), else the CPU's with CUDA's rules;
        the CPU's too for a GPU described by its ``capability`` (``--cuda-capability``). ``context_bytes``: the
        CUDA context as measured on the card (``--cuda-context``), else assumed."""
        context = CUDA_CONTEXT_BYTES if context_bytes is None else context_bytes
        if torch.cuda.is_available() and capability is None:
            device = torch.device("cuda", torch.cuda.current_device() if device is None or device.index is None
                                  else device.index)
            return cls(device, fake_cuda=True, capability=torch.cuda.get_device_capability(device),
                       context_bytes=context)
        return cls(torch.device("cpu"), capability=capability or ASSUMED_CAPABILITY, context_bytes=context,
                   described=(capability is not None, context_bytes is not None))

    findings_class = CudaFindings  # what predictions under these rules gather

    @contextlib.contextmanager
    def applied(self, findings: CudaFindings | None = None) -> Iterator[None]:
        """Inside: torch.optim's default implementation CUDA's (:func:`optimizers_as_on_cuda`); where the fake tensors
        are the CPU's, CUDA's autocast rules, dropout and attention kernels too, what they find told to ``findings``
        (None: forgotten)."""
        findings = CudaFindings() if findings is None else findings
        if self.fake_cuda:
            with optimizers_as_on_cuda():
                yield
            return
        with optimizers_as_on_cuda(), cuda_autocast_on_cpu() as unknown, dropout_as_on_cuda(), \
                cuda_attention_on_cpu(self.capability) as calls:
            findings.unknown_ops = unknown
            yield
        findings.attention.update(calls)

    def replayed(self, trace: tuple[tuple[int, ...], ...], budget_bytes: int | None) -> Replay:
        """The allocator's statistics for a trial's allocation trace, its cuBLAS workspaces first, within the
        budget (``set_per_process_memory_fraction``'s rule: reserved bytes)."""
        workspaces = workspace_trace(cublas_workspace_bytes(*self.capability), threads=2)
        return replay([*workspaces, *trace], settings=self.allocator, capacity_bytes=budget_bytes)

    def read(self, reading: MemoryReading, trace: tuple[tuple[int, ...], ...], budget_bytes: int | None) -> CudaReading:
        """A prediction's reading as CUDA's meter would give it (the budget compared with reserved bytes, NVML's
        figure beside), from the tensor meter's reading and allocation trace; and, where the modelled allocator
        runs out within the budget though the tensors alone fit, the out-of-memory error's line."""
        r = self.replayed(trace, budget_bytes)
        held = needed = None
        if r.oom:
            held, needed = r.reserved_bytes, r.reserved_bytes + (r.oom_request_bytes or 0)
        elif reading.oom_needed_bytes is not None:  # the tensors alone did not fit: the allocator needs more still
            held = r.reserved_bytes
            needed = max(reading.oom_needed_bytes, held)
        reserved = r.peak_reserved_bytes
        cuda = dataclasses.replace(reading, peak_bytes=max(reserved, needed or 0),
                                   peak_allocated_bytes=r.peak_allocated_bytes, peak_reserved_bytes=reserved,
                                   peak_nvml_bytes=nvml_bytes(reserved, context_bytes=self.context_bytes),
                                   oom_held_bytes=held, oom_needed_bytes=needed)
        error = None
        if r.oom:
            error = (f"CUDA out of memory (predicted: the modelled caching allocator could not reserve a segment of "
                     f"{format_bytes(r.oom_request_bytes)} with {format_bytes(r.reserved_bytes)} reserved, within "
                     f"the budget of {format_bytes(budget_bytes)})")
        return CudaReading(cuda, error)

    def describe(self, findings: CudaFindings) -> dict[str, Any]:
        """What the report's ``search.cuda`` records: where the predictions ran, what they assumed and found."""
        return {"predicted_on": "fake CUDA tensors" if self.fake_cuda else "fake CPU tensors, CUDA's autocast",
                "compute_capability": f"{self.capability[0]}.{self.capability[1]}",
                "compute_capability_source": "given" if self.described[0] or self.fake_cuda else "assumed",
                "context_source": "given" if self.described[1] else "assumed",
                "cublas_workspace_bytes": cublas_workspace_bytes(*self.capability), "cublas_workspaces": 2,
                "context_bytes": self.context_bytes, "expandable_segments": self.allocator.expandable_segments,
                "attention": dict(sorted(findings.attention.items())),
                "attention_order_assumed": None if self.fake_cuda else ORDER_ASSUMED,
                "autocast_ops_unknown": list(findings.unknown_ops)}

    def _source(self, which: int) -> str:
        """`` (assumed...)`` after a figure of the GPU the user did not give (``--cuda-capability``, ``--cuda-context``)."""
        if self.described[which] or (which == 0 and self.fake_cuda):
            return ""
        return f" (assumed: {('--cuda-capability', '--cuda-context')[which]} says the card's)"

    def notices(self, findings: CudaFindings) -> tuple[str, ...]:
        """What the predictions assumed where CUDA differs from the CPU, and what they found, one line each."""
        where = ("on fake CUDA tensors (this machine's GPU)" if self.fake_cuda else
                 "on fake CPU tensors with CUDA's autocast op lists" +
                 (" (this machine has no GPU)" if not torch.cuda.is_available() else " (another GPU than this one)"))
        settings = "expandable segments" if self.allocator.expandable_segments else "default settings"
        said = [f"--device cuda --dry-run: each trial predicted {where}; reserved bytes from its allocation trace by a "
                f"model of the caching allocator ({settings}), with 2 cuBLAS workspaces of "
                f"{format_bytes(cublas_workspace_bytes(*self.capability))} each, as on compute capability "
                f"{self.capability[0]}.{self.capability[1]}{self._source(0)}; NVML's figure adds a CUDA context of "
                f"{format_bytes(self.context_bytes)}{self._source(1)}; the optimizer's default is CUDA's (foreach), "
                f"dropout CUDA's fused kernel (a bool mask); the budget holds the reserved prediction. "
                f"benchmarks/gpu_check.py checks these against a GPU"]
        if findings.attention and not self.fake_cuda:
            ran = ", ".join(f"{kernel} {n}" for kernel, n in sorted(findings.attention.items()))
            said.append(f"attention predicted as CUDA's scaled_dot_product_attention would run it on compute capability "
                        f"{self.capability[0]}.{self.capability[1]} (calls by kernel: {ran}), kernels tried in the "
                        f"order {ORDER_ASSUMED}; what a kernel allocates inside (flash's float32 dq accumulator in "
                        f"backward) is not counted")
        if findings.unknown_ops:
            said.append(f"CUDA's autocast casts {', '.join(findings.unknown_ops)} in this torch, with a policy this "
                        f"autotune does not know: predicted with the CPU's")
        return tuple(said)

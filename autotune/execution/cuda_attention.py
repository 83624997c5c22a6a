"""The attention kernel CUDA would run, for a prediction made on the CPU: ``scaled_dot_product_attention`` as on a GPU.

``torch.nn.functional.scaled_dot_product_attention`` picks its kernel by the device: on the CPU its fused kernel
(or the composite "math" one), on CUDA FlashAttention 2, the memory-efficient kernel, cuDNN's or math, by rules of
the dtype, the head dimension, the mask, dropout and the GPU's compute capability. What each keeps for the backward
pass differs by orders of magnitude: flash and memory-efficient keep the output and a float32 log-sum-exp per query
and head, math the T x T scores and their softmax (in float32 for bf16 or fp16 inputs). A plan for a GPU made on the
CPU must run the GPU's choice: :func:`choose` makes it by the rules of ``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (read at pytorch/pytorch commit 001f694a, the torch 2.13
line), and :func:`cuda_attention_on_cpu` runs the chosen kernel's own op on the fake CPU tensors (each has a fake
kernel and a backward formula that are the device's), with the composite's preparation around it (``attention.cpp``:
a boolean mask made a bias of the query's dtype, padded to a multiple of 16 for the memory-efficient kernel, the
head dimension padded to a multiple of 8 for flash).

What cannot be known from here, and is assumed (the report's ``search.cuda`` and a notice say so):

- the kernels' order: torch's default (flash, memory-efficient, math; cuDNN last, never reached while math is on).
  A torch built with cuDNN newer than 9.15 prefers cuDNN on compute capability 9.0 and 10.x;
- the memory-efficient kernel's grouped-query attention: keys and values repeated to the query's heads, as the math
  kernel does (``enable_gqa``);
- storage offsets aligned (the memory-efficient kernel's pointer check), and no ``torch.nn.attention.sdpa_kernel``
  restricting the choice;
- workspaces the kernels allocate inside (flash's float32 accumulator of dq in backward) are not counted, here or by
  the tensor meter on the CPU.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
from typing import Any, Iterator

import torch

from autotune.vocabulary.attention import Attention

__all__ = ["choose", "cuda_attention_on_cpu", "ORDER_ASSUMED"]

ORDER_ASSUMED = ("flash, memory-efficient, math (torch's default order; a torch built with cuDNN newer than 9.15 "
                 "prefers cuDNN's kernel on compute capability 9.0 and 10.x)")

_HALF = (torch.float16, torch.bfloat16)
_registering = threading.Lock()


def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
           dropout_p: float, is_causal: bool, enable_gqa: bool, capability: tuple[int, int]) -> Attention:
    """The kernel CUDA's ``select_sdp_backend`` picks for this call on a GPU of ``capability``, in the default order."""
    dense = query.dim() == key.dim() == value.dim() == 4 and not query.is_nested
    if dense and min(query.shape[-2], key.shape[-2]) > 0 and _heads_ok(query, key, value, enable_gqa):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if _flash_ok(query, key, value, attn_mask, dropout_p, is_causal, capability, grad):
            return Attention.FLASH
        if _efficient_ok(query, key, value, capability):
            return Attention.EFFICIENT
    return Attention.MATH


def _heads_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal batches; equal heads, or grouped queries asked for."""
    if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[1] != value.shape[1]:
        return False
    return query.shape[1] == key.shape[1] or (enable_gqa and query.shape[1] % key.shape[1] == 0)


def _flash_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, capability: tuple[int, int], grad: bool) -> bool:
    """``can_use_flash_attention``: no mask, fp16 or bf16 on sm80 to sm121, one head dimension of at most 256 (at
    most 192 for training on sm86-89 and sm120-121, or above 224 without dropout), a causal mask only when square."""
    head = query.shape[-1]
    if attn_mask is not None or query.dtype not in _HALF or not (8, 0) <= capability <= (12, 1):
        return False
    if not head == key.shape[-1] == value.shape[-1] or head > 256:
        return False
    if grad and ((8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)):
        if not (head <= 192 or (dropout_p == 0.0 and head > 224)):
            return False
    if is_causal and query.shape[-2] != key.shape[-2]:
        return False
    return all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (query, key, value))


def _efficient_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, capability: tuple[int, int]) -> bool:
    """``can_use_mem_efficient_attention``: sm50 to sm121; fp16, fp32 (and bf16 from sm80); the query's and key's
    head dimension equal, it and the value's a multiple of the GEMM alignment (``minimum_gemm_alignment``)."""
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability >= (8, 0) else (torch.float16, torch.float32)
    if not (5, 0) <= capability <= (12, 1) or query.dtype not in dtypes:
        return False
    half = query.dtype in _HALF
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = max(4 if capability >= (8, 0) else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
    q, v = query.shape[-1], value.shape[-1]
    return q == key.shape[-1] and q % alignment == 0 and v % alignment == 0 and q > 0 and v > 0 and all(
        t.stride(-1) == 1 for t in (query, key, value))


def _as_bias(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a boolean mask becomes 0 where attended and -inf elsewhere, in ``dtype``."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask, torch.zeros((), dtype=dtype), torch.full((), -math.inf, dtype=dtype))


def _flash(query, key, value, dropout_p, is_causal, scale) -> torch.Tensor:
    """The composite's flash branch: head dimensions padded to a multiple of 8, the scale of the unpadded one."""
    head = query.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(head)
    pad = (-head) % 8
    q, k, v = ((torch.nn.functional.pad(t, (0, pad)) if pad else t) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head] if pad else out


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor:
    """The composite's memory-efficient branch: the mask a bias expanded to (B, H, L, S), padded to a multiple of 16
    (``preprocess_mask``); grouped keys and values repeated to the query's heads (assumed)."""
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    bias = _as_bias(attn_mask, query.dtype)
    if bias is not None:
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        if bias.shape[-1] % 16:
            pad = 16 - bias.shape[-1] % 16
            bias = torch.nn.functional.pad(bias, (0, pad))[..., :bias.shape[-1]]
        elif any(s % 16 for s in bias.stride()[:3]):
            bias = bias.contiguous()
    logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, logsumexp, dropout_p,
                                                                  is_causal, scale=scale)[0]


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, _as_bias(attn_mask, query.dtype),
                                                             dropout_p, is_causal, None, scale=scale,
                                                             enable_gqa=enable_gqa)[0]


@contextlib.contextmanager
def cuda_attention_on_cpu(capability: tuple[int, int]) -> Iterator[collections.Counter]:
    """Inside the block, ``scaled_dot_product_attention`` on CPU tensors runs the kernel CUDA would on a GPU of
    ``capability`` (:func:`choose`), after autocast's cast and under autograd (a kernel on the ``AutogradCPU`` key,
    where the composite's would run; process-wide, put back after). Yields the count of calls by kernel."""
    counts: collections.Counter = collections.Counter()

    def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
        chosen = choose(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, capability)
        counts[chosen.value] += 1
        if chosen is Attention.FLASH:
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if chosen is Attention.EFFICIENT:
            return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    with _registering:
        lib = torch.library.Library("aten", "IMPL")
        try:
            lib.impl("scaled_dot_product_attention", kernel, "AutogradCPU")
            yield counts
        finally:
            lib._destroy()

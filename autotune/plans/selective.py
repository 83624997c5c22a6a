"""Selective (per-operation) checkpointing: keep what is expensive to recompute, recompute the rest.

A block plan recomputes a block's whole forward pass. A selective plan wraps every block the same
way (each call checkpointed on its own, with its own arguments: :mod:`autotune.plans.checkpointing`),
but inside the checkpoint a policy decides per operation whether its output is kept for the
backward pass or recomputed (torch's :func:`~torch.utils.checkpoint.create_selective_checkpoint_contexts`,
as torchtitan's per-op mode and Megatron's selective recompute do):

The plans are listed once, as groups of operations kept (:data:`autotune.plans.SELECTIVE`):

* ``sac-matmul``: keep every matrix multiplication, convolution and attention kernel's output;
  recompute the element-wise work (activations, norms, softmax, dropout, residual sums).
* ``sac-linear``: keep only the linear layers' outputs (``addmm``/``mm``); recompute attention
  (its batched matmuls and the (T, T) scores) and the element-wise work. Less memory than
  ``sac-matmul`` where attention's scores are large.
* ``sac-lean``: as ``sac-matmul``, but keep only every other ``mm``/``addmm`` output
  (after torchtitan's policy): less memory, more recompute.
* ``sac-torchtitan``: torchtitan's per-op policy as its published Llama 3 rows ran it (its save list
  of December 2024): keep the fused attention kernels' outputs, ``abs`` and ``max`` (the amax of
  float8's scaling) and every other ``mm``; recompute the rest, ``addmm`` (a linear layer with a
  bias), ``bmm`` and convolutions included. On a model without biases and with fused attention
  (Llama) it keeps what ``sac-lean`` keeps.

Every other output of a group is counted per checkpointed call (each block call gets a fresh policy,
as torchtitan's does): the first, third, ... are kept. The recompute keeps what the forward pass kept:
torch 2.13's SAC replays the forward's decisions without asking the policy again, and a torch that
asks it (``ctx.is_recompute``) gets them from a count the policy keeps apart for that pass. Under
``torch.compile`` one policy per plan is traced (:func:`autotune.plans.checkpointing._traced_contexts`),
so the count runs on from block to block there.

Random operations are never kept: they run again in the recompute from the RNG state the
checkpoint saved, so dropout draws the same masks. The same recompute context that restores the
buffers a block's forward changed (BatchNorm's statistics) wraps the policy's, so one
``context_fn`` serves both (:func:`autotune.plans.checkpointing.apply_plan` puts them together). A kept output that the block later changes in place makes torch
raise in the backward pass: the plan's check on the model then fails and the plan is dropped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy

from autotune.vocabulary import SELECTIVE

__all__ = ["make_policy"]

aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The default overloads of the named aten ops this torch has (attention kernels vary by version)."""
    found = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.append(packet.default)
    return frozenset(found)


_MM = _ops("mm")  # nn.Linear without a bias (3-D inputs are flattened to 2-D), and 2-D matmuls
_LINEAR = _MM | _ops("addmm")  # nn.Linear: addmm with a bias, mm without
_BATCHED = _ops("bmm", "baddbmm")  # attention's q @ k^T and att @ v, written out
# torchtitan's list names the two CUDA kernels SDPA dispatches to; the others are the same attention elsewhere
_ATTENTION = _ops("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_flash_attention_forward", "_efficient_attention_forward")
_CONVOLUTION = _ops("convolution", "cudnn_convolution", "mkldnn_convolution")
_AMAX = _ops("abs", "max")  # max(abs(x)), float8's scaling factor: the whole-tensor max only (max.default)
_GROUPS = {"linear": _LINEAR, "mm": _MM, "batched": _BATCHED, "attention": _ATTENTION, "convolution": _CONVOLUTION,
           "amax": _AMAX}


def make_policy(name: str) -> Callable[..., CheckpointPolicy]:
    """A fresh policy of selective plan ``name`` for one checkpointed call (``policy_fn`` of torch's SAC).

    It keeps the outputs of the plan's ``save`` groups and every other output of its ``alternate``
    groups (the first, third, ...), counted per pass, so a recompute that asks again keeps exactly
    what the forward pass kept; the rest is recomputed.
    """
    plan = SELECTIVE[name]
    save = frozenset().union(*(_GROUPS[g] for g in plan.save))
    alternate = frozenset().union(*(_GROUPS[g] for g in plan.alternate))
    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in alternate:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy

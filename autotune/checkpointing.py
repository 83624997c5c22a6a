"""Gradient-checkpoint plans: find a model's chain of repeated blocks and recompute it in segments.

A plan with ``segments = s`` cuts a chain of L blocks into s contiguous segments. During the
forward pass only each segment's input is kept; backward recomputes one segment at a time, so
peak activation memory falls from O(L) blocks to O(s + L/s), smallest near s = sqrt(L). As in
``torch.utils.checkpoint.checkpoint_sequential``, the last segment is not checkpointed: its
activations are needed as soon as backward starts, so recomputing it would cost time and save
nothing. ``segments = 0`` is no checkpointing (and so, in effect, is ``segments = 1``).

Two kinds of chain are found automatically:

* an ``nn.Sequential``: its forward becomes ``checkpoint_sequential(use_reentrant=False)``;
* an ``nn.ModuleList`` of blocks of one type that the model's own forward loops over (a GPT or
  Hugging Face transformer): the first block of each segment runs the whole segment under one
  non-reentrant ``checkpoint`` and the segment's other blocks hand its result on. Blocks may
  return tuples (the first element is the hidden state passed to the next block); every block
  of a segment receives the extra arguments its first block was called with.

Plans patch ``forward`` on module instances, so parameters and ``state_dict`` keys are untouched
and :func:`remove_plan` restores the model.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from autotune.errors import AutotuneError, UsageError

__all__ = ["Chain", "AppliedPlan", "find_chain", "auto_segment_counts", "apply_plan", "remove_plan"]


@dataclasses.dataclass(frozen=True)
class Chain:
    """A run of blocks the model executes one after the other."""

    path: str  # dotted module path inside the model ("" is the model itself)
    kind: str  # "sequential" or "module_list"
    length: int  # L, the number of modules in the chain
    block_type: str  # class name of the repeated block


@dataclasses.dataclass(frozen=True)
class AppliedPlan:
    """The checkpoint plan applied to a model, as reported in the JSON."""

    segments: int
    chain: Chain | None
    checkpointed: tuple[tuple[int, int], ...] = ()  # [start, end) block ranges recomputed in backward

    def to_dict(self) -> dict[str, Any]:
        return {
            "segments": self.segments,
            "module": self.chain.path if self.chain else None,
            "kind": self.chain.kind if self.chain else None,
            "chain_length": self.chain.length if self.chain else None,
            "block_type": self.chain.block_type if self.chain else None,
            "checkpointed_blocks": [list(r) for r in self.checkpointed],
        }


def find_chain(model: nn.Module) -> Chain | None:
    """Return the model's longest chain of same-type blocks, or ``None`` when it has none.

    Candidates are ``nn.ModuleList`` containers whose children all share one type, and
    ``nn.Sequential`` containers (whose every child is part of the chain); a candidate scores the
    number of children of its most common type and needs at least two. The highest score wins;
    on a tie, the outermost container.
    """
    best: Chain | None = None
    best_score = 1
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Sequential, nn.ModuleList)) or len(module) < 2:
            continue
        counts = collections.Counter(type(child) for child in module)
        block_type, score = counts.most_common(1)[0]
        if isinstance(module, nn.ModuleList) and len(counts) > 1:
            continue
        if score > best_score:
            kind = "sequential" if isinstance(module, nn.Sequential) else "module_list"
            best = Chain(path, kind, len(module), block_type.__name__)
            best_score = score
    return best


def auto_segment_counts(length: int) -> list[int]:
    """Return the spread of segment counts ``--segments auto`` tries for a chain of ``length``.

    0 (off), the powers of two below ``length``, round(sqrt(length)) and ``length`` itself.
    """
    if length < 2:
        return [0]
    counts = {0, length, max(2, round(math.sqrt(length)))}
    counts.update(2**k for k in range(1, length.bit_length()) if 2**k < length)
    return sorted(counts)


def _segment_bounds(length: int, segments: int) -> list[tuple[int, int]]:
    """Cut ``range(length)`` into ``segments`` contiguous [start, end) ranges, sizes differing by at most one."""
    bounds, start = [], 0
    for i in range(segments):
        end = start + length // segments + (1 if i < length % segments else 0)
        bounds.append((start, end))
        start = end
    return bounds


def apply_plan(model: nn.Module, segments: int, chain: Chain | None = None) -> AppliedPlan:
    """Apply a checkpoint plan of ``segments`` segments to ``model`` in place; return what was done.

    ``chain`` defaults to :func:`find_chain`. ``segments = 0`` leaves the model unchanged.
    """
    if segments < 0:
        raise UsageError(f"segments must be 0 (off) or a positive count, not {segments}")
    if segments == 0:
        return AppliedPlan(0, chain)
    chain = chain if chain is not None else find_chain(model)
    if chain is None:
        raise UsageError(
            f"{type(model).__name__} has no chain of repeated blocks to checkpoint: use --segments 0"
        )
    if segments > chain.length:
        raise UsageError(
            f"--segments {segments} is more than the {chain.length} blocks of "
            f"{chain.path or type(model).__name__}: use at most {chain.length}"
        )
    container = model.get_submodule(chain.path)
    if chain.kind == "sequential":
        container.forward = functools.partial(_checkpointed_sequential, container, segments)
        # checkpoint_sequential's own split: segments of len // segments, the rest in the last one
        size = chain.length // segments
        checkpointed = tuple((i * size, (i + 1) * size) for i in range(segments - 1))
        return AppliedPlan(segments, chain, checkpointed)
    blocks = list(container)
    bounds = _segment_bounds(len(blocks), segments)
    for start, end in bounds[:-1]:
        _group(blocks[start:end], name=f"{chain.path}[{start}:{end}]")
    return AppliedPlan(segments, chain, tuple(bounds[:-1]))


def remove_plan(model: nn.Module) -> None:
    """Undo :func:`apply_plan` on every module of ``model``."""
    for module in model.modules():
        if "forward" in vars(module):
            del module.forward


def _checkpointed_sequential(container: nn.Sequential, segments: int, input: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return nn.Sequential.forward(container, input)
    return checkpoint_sequential(container, segments, input, use_reentrant=False)


class _Segment:
    """Blocks recomputed as one unit: the first runs them all, the others pass its result on."""

    def __init__(self, blocks: list[nn.Module], name: str) -> None:
        self.forwards = [type(block).forward.__get__(block) for block in blocks]
        self.name = name
        self.pending: Any = None  # the segment's output, until the last block has handed it on
        self.hidden: Any = None  # the hidden state the next block must be called with
        self.remaining = 0

    def run(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        out = None
        for forward in self.forwards:
            out = forward(hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, (tuple, list)) else out
        return out

    def head(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            out = checkpoint(self.run, *args, use_reentrant=False, **kwargs)
        else:
            out = self.run(*args, **kwargs)
        self.pending, self.remaining = out, len(self.forwards) - 1
        self.hidden = out[0] if isinstance(out, (tuple, list)) else out
        return out

    def follower(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        if self.remaining == 0 or hidden is not self.hidden:
            self.pending = self.hidden = None
            raise AutotuneError(
                f"checkpoint segment {self.name}: the model does not pass each block's output straight "
                f"to the next block, so blocks cannot be grouped; use --segments equal to the number of blocks "
                f"or 0"
            )
        out = self.pending
        self.remaining -= 1
        if self.remaining == 0:
            self.pending = self.hidden = None
        return out


def _group(blocks: list[nn.Module], name: str) -> None:
    segment = _Segment(blocks, name)
    blocks[0].forward = segment.head
    for block in blocks[1:]:
        block.forward = segment.follower

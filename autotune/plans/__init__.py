"""Checkpoint plan names: which of a model's L blocks a plan recomputes in the backward pass.

A plan is named in ``--segments`` and stored under that name in trials and reports. Every plan
is a set of blocks, each recomputed on its own with exactly the arguments of its own call
(:mod:`autotune.plans.checkpointing`), so plans differ only in how many and which blocks they pick:

* ``0``: no checkpointing.
* ``N`` (an integer, 1 <= N <= L): the blocks cut into N contiguous segments of sizes differing
  by at most one; the blocks of the first N - 1 segments are recomputed, the last segment is not
  (its activations are needed as soon as backward starts). ``1`` recomputes nothing, like ``0``.
* ``all``: every block, the last included: the least memory (the library switches of
  transformers and timm do this).
* ``everyN`` (``every2``, ``every4``, ...): blocks 0, N, 2N, ...: transformers' ``every_n_layers``.
  A smooth trade-off between memory and recompute time.
* ``sac-matmul``, ``sac-linear``, ``sac-lean``: selective plans (:mod:`autotune.plans.selective`).
  Every block is wrapped, and inside it a per-operation policy keeps the outputs of matmuls
  (all of them; only the linear layers'; every other linear one) and recomputes the rest: a
  point between no checkpointing and recomputing whole blocks.

This module holds no torch: the search strategies and the memory model read plans through it.
"""

from __future__ import annotations

import re

from autotune.errors import UsageError

__all__ = ["NONE", "ALL", "SELECTIVE", "SELECTIVE_POLICIES", "canonical", "parse_plans", "recomputed_blocks", "recompute_fraction",
           "needs_no_more_memory", "plan_order", "auto_plans", "check_plan_fits", "is_off", "is_selective"]

NONE = "0"
ALL = "all"
_EVERY = re.compile(r"^every(\d+)$")
# Selective plans, with the share of a block's activation memory each is expected to free (a prior for
# the memory model and the plans' order; measured on TinyGPT, fp32, batch 16: README "Selective plans").
SELECTIVE = {"sac-matmul": 0.15, "sac-lean": 0.2, "sac-linear": 0.75}
SELECTIVE_POLICIES = {  # what each keeps (autotune.plans.selective has the policies), for the JSON and the exports' notes
    "sac-matmul": "keep matmul, convolution and attention outputs; recompute the rest",
    "sac-linear": "keep the linear layers' outputs; recompute attention and the element-wise work",
    "sac-lean": "keep attention, convolution and every other linear layer's outputs; recompute the rest",
}
_HINT = "0 (off), a segment count such as 2, all, everyN such as every2, sac-matmul, sac-linear, sac-lean, or auto"


def canonical(name: str | int) -> str:
    """Return the plan's canonical name (``"0"``, ``"3"``, ``"all"``, ``"every2"``); raise UsageError if unknown.

    Integers (reports of schema version 1 stored segment counts as numbers) are accepted.
    """
    text = str(name).strip().lower()
    if text.isdigit():
        return str(int(text))
    if text == ALL or text in SELECTIVE:
        return text
    match = _EVERY.match(text)
    if match and int(match.group(1)) >= 1:
        return f"every{int(match.group(1))}"
    raise UsageError(f"unknown checkpoint plan {str(name)!r} in --segments: write {_HINT}")


def parse_plans(text: str) -> tuple[str, ...] | None:
    """Parse ``--segments``: ``"auto"`` (``None``, resolved against the model's blocks) or a list ``"0,2,all"``."""
    if text.strip() == "auto":
        return None
    names = tuple(dict.fromkeys(canonical(part) for part in text.split(",") if part.strip()))
    if not names:
        raise UsageError(f"--segments {text!r} is empty: write {_HINT}")
    return names


def is_selective(name: str) -> bool:
    """True for the per-operation plans (``sac-*``)."""
    return name in SELECTIVE


def is_off(name: str) -> bool:
    """True for plans that recompute nothing whatever the model (``0`` and ``1``)."""
    return name in (NONE, "1")


def recomputed_blocks(name: str, length: int) -> tuple[int, ...]:
    """The indices (in forward order) of the blocks plan ``name`` recomputes, for a model of ``length`` blocks."""
    name = canonical(name)
    if name == ALL or name in SELECTIVE:  # a selective plan wraps every block; its policy decides per operation
        return tuple(range(length))
    match = _EVERY.match(name)
    if match:
        return tuple(range(0, length, int(match.group(1))))
    segments = int(name)
    if segments <= 1 or length == 0:
        return ()
    segments = min(segments, length)
    last_start = length - (length // segments)  # the last segment holds length // segments blocks
    return tuple(range(last_start))


def recompute_fraction(name: str, length: int | None) -> float:
    """The share of the blocks plan ``name`` recomputes (0 to 1); without ``length`` a guess from the name.

    For a selective plan: the share of activation memory it is expected to free, a prior (every
    block is wrapped, but only part of each is recomputed).
    """
    name = canonical(name)
    if name in SELECTIVE:
        return SELECTIVE[name]
    if length:
        return len(recomputed_blocks(name, length)) / length
    if name == ALL:
        return 1.0
    match = _EVERY.match(name)
    if match:
        return 1.0 / int(match.group(1))
    segments = int(name)
    return 0.0 if segments <= 1 else (segments - 1) / segments


def needs_no_more_memory(a: str, b: str, length: int | None) -> bool:
    """Whether plan ``a`` is known to need no more memory than plan ``b`` at any batch size (a partial order).

    Block plans whose recomputed blocks are nested are ordered: recomputing a superset of ``b``'s
    blocks keeps less. ``all`` recomputes every operation of every block, so it keeps less than any
    selective plan; a selective plan that keeps a subset of another's outputs (``sac-linear`` and
    ``sac-lean`` of ``sac-matmul``'s) keeps less. Selective plans and the other block plans are not
    ordered (a kept matmul output may be one no block plan holds). Without ``length`` only ``a == b``.
    """
    a, b = canonical(a), canonical(b)
    if a == b:
        return True
    if not length:
        return False
    if is_selective(a) or is_selective(b):
        if is_selective(a) and is_selective(b):
            return b == "sac-matmul" and a in ("sac-linear", "sac-lean")
        return is_selective(b) and len(recomputed_blocks(a, length)) == length  # a recomputes every block
    return set(recomputed_blocks(b, length)) <= set(recomputed_blocks(a, length))


def plan_order(names, length: int | None) -> list[str]:
    """``names`` from the least recompute to the most (and so, roughly, fastest and largest first)."""
    return sorted(names, key=lambda n: (recompute_fraction(n, length), n != NONE, n))


def check_plan_fits(name: str, length: int, where: str) -> None:
    """Raise UsageError when plan ``name`` asks for more segments or a wider stride than ``length`` blocks have."""
    name = canonical(name)
    match = _EVERY.match(name)
    number = int(match.group(1)) if match else (int(name) if name.isdigit() else None)
    if number is not None and number > length:
        raise UsageError(f"--segments {name} is more than the {length} blocks of {where}: use at most {length}")


def auto_plans(length: int) -> list[str]:
    """The spread of plans ``--segments auto`` tries for ``length`` blocks, least recompute first.

    ``0``, ``every4`` (a quarter of the blocks), the powers of two below ``length`` as segment
    counts (half, three quarters, ... of the blocks) and ``all``; plans that would recompute the
    same blocks as an earlier one are left out. Then the selective plans.
    """
    if length < 1:
        return [NONE]
    names = [NONE, "every4", *(str(2**k) for k in range(1, length.bit_length()) if 2**k < length), ALL]
    seen: dict[tuple[int, ...], str] = {}
    for name in names:
        if name.startswith("every") and int(name[5:]) > length:
            continue
        seen.setdefault(recomputed_blocks(name, length), name)
    return plan_order([*seen.values(), *SELECTIVE], length)

"""Checkpoint plans: which of a model's L blocks a plan recomputes in the backward pass, and how.

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
* ``sac-matmul``, ``sac-linear``, ``sac-lean``, ``sac-torchtitan``: selective plans (:data:`SELECTIVE`).
  Every block is wrapped, and inside it a per-operation policy (:mod:`autotune.plans.selective`)
  keeps the outputs of some operations and recomputes the rest: a point between no checkpointing
  and recomputing whole blocks.
* ``PLAN+offload`` (``0+offload``, ``all+offload``, ``sac-linear+offload``): the plan, and what it
  keeps for the backward pass (saved tensors of blocks not recomputed, the inputs recomputed
  blocks keep) held in host memory in between (:mod:`autotune.plans.offload`, ``--offload
  activations``). It recomputes what its base plan recomputes; the copies change no value.
* ``PLAN+state`` (``0+state``, ``all+offload+state``): the plan, trained under FSDP2 with the training
  state (sharded parameters, gradients, optimizer state) in host memory and the optimizer's step on
  the CPU (``CPUOffloadPolicy``, ``--offload state`` under ``--parallel fsdp``,
  :mod:`autotune.training.host_state`). The model's forward and backward are the plan's; only where
  the state lives changes.

:class:`Plan` is a plan's name that knows its blocks, its recompute share, its label and its
description; everything else asks it. Its modifiers (``+offload``, ``+state``) are one
:class:`Offload` value, read from the table :data:`MODIFIERS`: a new modifier is a row there (its
suffix, its ``--offload`` mode, its words) and its application where it is applied. A new kind of
plan is a case here and, if it is applied differently, in
:func:`autotune.plans.checkpointing.apply_plan`. This module holds no torch: the search strategies
and the memory model read plans through it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Iterable

from autotune.errors import UsageError

__all__ = ["Plan", "Selective", "Offload", "Modifier", "MODIFIERS", "NONE", "ALL", "SELECTIVE", "parse_plans",
           "parse_offload", "plan_order", "auto_plans", "with_offload"]

NONE = "0"
ALL = "all"
_EVERY = re.compile(r"^every(\d+)$")


class Offload(enum.Flag):
    """What a plan holds in host memory: nothing, the tensors kept for the backward pass, the training state, or both.

    It is also an ``--offload`` mode: ``str(Offload.ACTIVATIONS | Offload.STATE)`` is ``"activations+state"``, and
    :func:`parse_offload` reads the modes back. Plans of one offload share a memory line's shape and an order.
    """

    NONE = 0
    ACTIVATIONS = enum.auto()  # --offload activations: a plan +offload
    STATE = enum.auto()  # --offload state: a plan +state (FSDP2's CPUOffloadPolicy)

    def __str__(self) -> str:
        return "+".join(m.mode for m in MODIFIERS if m.offload in self) or "none"

    @classmethod
    def parse(cls, text: str) -> "Offload":
        """``"activations+state"`` (or ``"state+activations"``, ``"none"``): the mode; unknown words raise UsageError."""
        words = [w for w in text.strip().lower().split("+") if w]
        found = [m for m in MODIFIERS if m.mode in words]
        unknown = [w for w in words if w not in {m.mode for m in MODIFIERS} | {"none"}]
        if unknown or not words:
            raise UsageError(f"unknown --offload mode {text!r}: write none, activations, state, activations+state "
                             f"(several with commas: none,activations) or auto")
        mode = cls.NONE
        for modifier in found:
            mode |= modifier.offload
        return mode


@dataclasses.dataclass(frozen=True)
class Modifier:
    """A plan's modifier: its suffix in a plan's name, its ``--offload`` mode, and its words for tables and lines."""

    suffix: str  # "+offload"
    mode: str  # the --offload mode that adds it: "activations"
    offload: Offload
    label: str  # appended to the base plan's label: "offloaded"
    describe: str  # appended to the base plan's description


MODIFIERS = (  # in the order a canonical name writes them
    Modifier("+offload", "activations", Offload.ACTIVATIONS, "offloaded",
             "what it keeps for the backward pass held in host memory (activation offload)"),
    Modifier("+state", "state", Offload.STATE, "state on the host",
             "the training state held in host memory and the optimizer step on the CPU (FSDP2's CPUOffloadPolicy)"),
)


@dataclasses.dataclass(frozen=True)
class Selective:
    """A selective plan: which operations' outputs it keeps (the rest is recomputed), as groups of aten ops.

    The groups (:mod:`autotune.plans.selective`): ``linear`` (``mm``/``addmm``), ``mm`` (``mm`` alone: a linear
    layer without a bias), ``batched`` (``bmm``/``baddbmm``), ``attention`` (the fused attention kernels),
    ``convolution``, ``amax`` (``abs`` and the whole-tensor ``max``: float8's scaling factors).
    """

    prior: float  # the share of a block's activation memory it is expected to free: the memory model's prior
    keeps: str  # what it keeps, in words (the JSON and the exports' notes)
    save: tuple[str, ...]  # groups whose every output is kept
    alternate: tuple[str, ...] = ()  # groups of which every other output is kept (counted per block call and pass)
    auto: bool = True  # one of the plans --segments auto searches


# The selective plans, listed once. Priors measured on TinyGPT, fp32, batch 16 (docs/plans.md, "Selective plans").
SELECTIVE = {
    "sac-matmul": Selective(0.15, "keep matmul, convolution and attention outputs; recompute the rest",
                            ("linear", "batched", "attention", "convolution")),
    "sac-lean": Selective(0.2, "keep attention, convolution and every other linear layer's outputs; recompute the rest",
                          ("batched", "attention", "convolution"), alternate=("linear",)),
    "sac-linear": Selective(0.75, "keep the linear layers' outputs; recompute attention and the element-wise work",
                            ("linear",)),
    # torchtitan's per-op policy as its Llama 3 rows ran it (December 2024): on a model whose linear layers have no
    # bias and whose attention is fused it keeps what sac-lean keeps, so --segments auto leaves it to be named. It keeps
    # nothing of TinyGPT's blocks (biases, attention written out): its prior is plan all's there (84% freed)
    "sac-torchtitan": Selective(0.85, "keep attention, max/abs and every other mm output (torchtitan's per-op policy); "
                                     "recompute addmm, bmm, convolutions and the element-wise work",
                                ("attention", "amax"), alternate=("mm",), auto=False),
}
_HINT = ("0 (off), a segment count such as 2, all, everyN such as every2, sac-matmul, sac-linear, sac-lean, "
         "sac-torchtitan (any of them with +offload, +state or both), or auto")


class Plan(str):
    """A checkpoint plan: its canonical name (a ``str``: ``"0"``, ``"3"``, ``"all"``, ``"every2"``, ``"sac-linear"``).

    ``Plan(" ALL ")`` is ``"all"``; an unknown name raises :class:`UsageError`. Integers (reports of
    schema version 1 stored segment counts as numbers) are accepted.
    """

    def __new__(cls, name: str | int) -> "Plan":
        if isinstance(name, Plan):
            return name
        text = str(name).strip().lower().replace(" ", "")
        if "+" in text:
            base, *modifiers = text.split("+")
            unknown = [m for m in modifiers if f"+{m}" not in {m.suffix for m in MODIFIERS}]
            if unknown:
                raise UsageError(f"unknown checkpoint plan {str(name)!r} in --segments (no +{unknown[0]}): write {_HINT}")
            named = "".join(m.suffix for m in MODIFIERS if m.suffix[1:] in modifiers)
            return super().__new__(cls, Plan(base).base + named)
        if text.isdigit():
            text = str(int(text))
        elif text not in (ALL, *SELECTIVE):
            match = _EVERY.match(text)
            if not match or int(match.group(1)) < 1:
                raise UsageError(f"unknown checkpoint plan {str(name)!r} in --segments: write {_HINT}")
            text = f"every{int(match.group(1))}"
        return super().__new__(cls, text)

    def __getnewargs__(self) -> tuple[str]:
        return (str(self),)

    @property
    def modifiers(self) -> tuple[Modifier, ...]:
        """The modifiers in the name, in :data:`MODIFIERS`' order: ``all+offload+state`` has both."""
        suffixes = {f"+{word}" for word in self.split("+")[1:]}
        return tuple(m for m in MODIFIERS if m.suffix in suffixes)

    @property
    def offload_mode(self) -> Offload:
        """What the plan holds in host memory (its modifiers): the ``--offload`` mode that makes it from its base.
        Plans of one offload share a memory line's shape and an order."""
        mode = Offload.NONE
        for modifier in self.modifiers:
            mode |= modifier.offload
        return mode

    @property
    def offload(self) -> bool:
        """Whether what the plan keeps for the backward pass waits in host memory (``PLAN+offload``)."""
        return Offload.ACTIVATIONS in self.offload_mode

    @property
    def state(self) -> bool:
        """Whether the training state waits in host memory (``PLAN+state``: FSDP2's ``CPUOffloadPolicy``)."""
        return Offload.STATE in self.offload_mode

    @property
    def base(self) -> "Plan":
        """The checkpoint plan without modifiers: ``all`` for ``all+offload`` and ``all+offload+state``."""
        return Plan(self.split("+")[0]) if "+" in self else self

    def without(self, offload: Offload) -> "Plan":
        """The plan less the modifiers in ``offload``: ``all+offload`` is ``all+offload+state`` without the state."""
        return Plan(self.base + "".join(m.suffix for m in self.modifiers if m.offload not in offload))

    @property
    def without_state(self) -> "Plan":
        """The plan as the model sees it: ``all+offload`` for ``all+offload+state`` (the state is the wrapper's)."""
        return self.without(Offload.STATE)

    @property
    def off(self) -> bool:
        """True for plans that change nothing whatever the model (``0`` and ``1``; not ``0+offload``)."""
        return self in (NONE, "1")

    @property
    def selective(self) -> Selective | None:
        """The per-operation policy of a selective plan (``sac-*``, offloaded or not), else None."""
        return SELECTIVE.get(self.base)

    @property
    def every(self) -> int | None:
        """N for ``everyN`` (transformers' ``every_n_layers``; ``all`` is N = 1), else None."""
        base = self.base
        if base == ALL:
            return 1
        match = _EVERY.match(base)
        return int(match.group(1)) if match else None

    @property
    def segments(self) -> int | None:
        """N for a segment count ``N``, else None."""
        return int(self.base) if self.base.isdigit() else None

    def blocks(self, length: int) -> tuple[int, ...]:
        """The indices (in forward order) of the blocks this plan recomputes, for a model of ``length`` blocks."""
        if self.selective or self.base == ALL:  # a selective plan wraps every block; its policy decides per operation
            return tuple(range(length))
        if self.every:
            return tuple(range(0, length, self.every))
        segments = int(self.base)
        if segments <= 1 or length == 0:
            return ()
        segments = min(segments, length)
        last_start = length - (length // segments)  # the last segment holds length // segments blocks
        return tuple(range(last_start))

    def recompute_share(self, length: int | None) -> float:
        """The share of the blocks this plan recomputes (0 to 1), the memory model's prior; without ``length``
        a guess from the name. For a selective plan: the share of activation memory it is expected to free."""
        if self.selective:
            return self.selective.prior
        if length:
            return len(self.blocks(length)) / length
        if self.every:
            return 1.0 / self.every
        return 0.0 if int(self.base) <= 1 else (int(self.base) - 1) / int(self.base)

    def needs_no_more_memory_than(self, other: str, length: int | None) -> bool:
        """Whether this plan is known to need no more memory than ``other`` at any batch size (a partial order).

        Block plans whose recomputed blocks are nested are ordered: recomputing a superset of the
        other's blocks keeps less. ``all`` recomputes every operation of every block, so it keeps less
        than any selective plan; a selective plan that keeps a subset of another's outputs keeps less.
        Selective plans and the other block plans are not ordered (a kept matmul output may be one no
        block plan holds). Without ``length`` only a plan and itself.
        """
        other = Plan(other)
        if self == other:
            return True
        if not length or self.offload_mode or other.offload_mode:
            return False  # an offloaded plan may fail for the host's memory: its failures imply nothing of another's
        mine, theirs = self.selective, other.selective
        if mine and theirs:
            return set(mine.save) | set(mine.alternate) <= set(theirs.save) and mine.save != theirs.save
        if mine or theirs:
            return theirs is not None and len(self.blocks(length)) == length  # this plan recomputes every block
        return set(other.blocks(length)) <= set(self.blocks(length))

    def fits(self, length: int, where: str) -> None:
        """Raise UsageError when this plan asks for more segments or a wider stride than ``length`` blocks have."""
        number = self.segments if self.segments is not None else (self.every if self != ALL else None)
        if number is not None and number > length:
            raise UsageError(f"--segments {self} is more than the {length} blocks of {where}: use at most {length}")

    @property
    def label(self) -> str:
        """A short label for tables and plots: ``no checkpointing``, ``segments 4``, ``every 2nd block``, ..."""
        if self.modifiers:
            return ", ".join([self.base.label, *(m.label for m in self.modifiers)])
        if self.off:
            return "no checkpointing"
        if self == ALL:
            return "all blocks"
        if self.selective:
            return f"selective {self}"
        if self.every:
            return f"every {_ordinal(self.every)} block"
        return f"segments {self}"

    def describe(self, blocks: str) -> str:
        """One line saying what the plan recomputes of ``blocks`` (e.g. ``"12 blocks (transformer.h)"``)."""
        if self.modifiers:
            return ", ".join([self.base.describe(blocks), *(m.describe for m in self.modifiers)])
        if self.off:
            return f"checkpoint plan {self}: nothing recomputed"
        if self == ALL:
            return f"checkpoint plan all (every one of {blocks} recomputed)"
        if self.selective:
            return (f"selective checkpoint plan {self} (every one of {blocks} wrapped, with a per-operation policy: "
                    f"{self.selective.keeps})")
        if self.every:
            return f"checkpoint plan {self} (every {self.every}th of {blocks} recomputed)"
        return f"checkpoint plan {self} ({self} segments over {blocks}, the last not recomputed)"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def parse_plans(text: str) -> tuple[Plan, ...] | None:
    """Parse ``--segments``: ``"auto"`` (``None``, resolved against the model's blocks) or a list ``"0,2,all"``."""
    if text.strip() == "auto":
        return None
    names = tuple(dict.fromkeys(Plan(part) for part in text.split(",") if part.strip()))
    if not names:
        raise UsageError(f"--segments {text!r} is empty: write {_HINT}")
    return names


def parse_offload(value: str | Iterable[str | Offload] | None) -> tuple[Offload, ...] | None:
    """``--offload`` as modes (``none,activations``), or None for ``auto`` (resolved against the device)."""
    if value is None or (isinstance(value, str) and value.strip() == "auto"):
        return None
    parts = [p for p in (value.split(",") if isinstance(value, str) else value) if str(p).strip()]
    if not parts:
        raise UsageError(f"--offload {value!r} is empty: write none, activations, state, none,activations or auto")
    return tuple(dict.fromkeys(p if isinstance(p, Offload) else Offload.parse(p) for p in parts))


def with_offload(plans: Iterable[str], modes: Iterable[Offload | str]) -> tuple[Plan, ...]:
    """``plans`` for each ``--offload`` mode: ``none`` keeps them, ``activations`` adds each one offloaded, ``state``
    each one with the state in host memory (``activations+state``: each with both). A plan named with its offload
    (``all+offload`` in ``--segments``) is searched as named, whatever the modes."""
    plans, modes = [Plan(p) for p in plans], [m if isinstance(m, Offload) else Offload.parse(m) for m in modes]
    bare = [p for p in plans if p == p.base]
    named = [Plan(p + "".join(m.suffix for m in MODIFIERS if m.offload in mode)) for mode in modes for p in bare]
    return tuple(dict.fromkeys([*named, *(p for p in plans if p != p.base)]))


def plan_order(names: Iterable[str], length: int | None) -> list[Plan]:
    """``names`` from the least recompute to the most (and so, roughly, fastest and largest first)."""
    return sorted(map(Plan, names), key=lambda n: (n.recompute_share(length), n != NONE, n))


def auto_plans(length: int) -> list[Plan]:
    """The spread of plans ``--segments auto`` tries for ``length`` blocks, least recompute first.

    ``0``, ``every4`` (a quarter of the blocks), the powers of two below ``length`` as segment
    counts (half, three quarters, ... of the blocks) and ``all``; plans that would recompute the
    same blocks as an earlier one are left out. Then the selective plans (but ``sac-torchtitan``, searched where named).
    """
    if length < 1:
        return [Plan(NONE)]
    names = [Plan(n) for n in (NONE, "every4", *(str(2**k) for k in range(1, length.bit_length()) if 2**k < length), ALL)]
    seen: dict[tuple[int, ...], Plan] = {}
    for plan in names:
        if plan.every and plan.every > length:
            continue
        seen.setdefault(plan.blocks(length), plan)
    return plan_order([*seen.values(), *(name for name, plan in SELECTIVE.items() if plan.auto)], length)

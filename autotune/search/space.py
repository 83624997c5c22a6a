"""The search space: precision modes x checkpoint plans x compile modes x batch sizes, and the parsers for its flags."""

from __future__ import annotations

import dataclasses
import re

from autotune.errors import UsageError
from autotune.vocabulary import EAGER, NOT_OFFERED, PRECISION_NAMES, Config, Plan, Variant, parse_compile, plan_order

__all__ = ["Config", "SearchSpace", "parse_batch_sizes", "parse_precisions"]


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Every combination of the given precisions, checkpoint plans, compile modes and batch sizes."""

    precisions: tuple[str, ...]
    plans: tuple[Plan, ...]  # the checkpoint plans (ordered_plans() sorts them by recompute); the JSON's "segments"
    batch_sizes: tuple[int, ...]
    blocks: int | None = None  # L, the model's repeated blocks the plans count in (None: no blocks)
    compiles: tuple[str, ...] = (EAGER,)  # torch.compile modes ("none": eager), the JSON's "compile"

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", tuple(Plan(s) for s in self.plans))
        object.__setattr__(self, "compiles", parse_compile(self.compiles))
        for name, values in (("precisions", self.precisions), ("checkpoint plans", self.plans),
                             ("batch sizes", self.batch_sizes)):
            if not values:
                raise UsageError(f"the search space is empty: no {name} to try")

    def ordered_plans(self) -> list[str]:
        """The space's plans from the least recompute to the most."""
        return plan_order(self.plans, self.blocks)

    @property
    def compiled(self) -> bool:
        """Whether any configuration trains compiled."""
        return any(c != EAGER for c in self.compiles)

    def configs(self) -> list[Config]:
        """Return every configuration: by compile mode, precision, then plan as given, then ascending batch size."""
        return [v.at(b) for v in self.variants() for b in sorted(self.batch_sizes)]

    def variants(self) -> list[Variant]:
        """Return every (precision, plan, compile mode), in the order of :meth:`configs` (a compile mode's together:
        a worker compiles each variant once and keeps it)."""
        return [Variant(p, s, c) for c in self.compiles for p in self.precisions for s in self.plans]

    def __len__(self) -> int:
        return len(self.precisions) * len(self.plans) * len(self.batch_sizes) * len(self.compiles)

    @classmethod
    def from_dict(cls, data: dict) -> "SearchSpace":
        """The inverse of :meth:`to_dict` (a report's ``search.space``)."""
        return cls(tuple(data["precisions"]), tuple(data["segments"]), tuple(data["batch_sizes"]), data.get("blocks"),
                   tuple(data.get("compile") or (EAGER,)))

    def to_dict(self) -> dict[str, list]:
        return {"precisions": list(self.precisions), "segments": list(self.plans), "batch_sizes": list(self.batch_sizes),
                "blocks": self.blocks, "compile": list(self.compiles)}


_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")


def _int_list(text: str, flag: str, hint: str, minimum: int) -> tuple[int, ...]:
    """Parse a comma-separated list of integers, sorted and without repeats."""
    try:
        values = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise UsageError(f"cannot read {flag} {text!r}: write {hint}") from None
    if not values:
        raise UsageError(f"{flag} {text!r} is empty: write {hint}")
    if values[0] < minimum:
        raise UsageError(f"{flag} {text!r}: values must be at least {minimum}")
    return values


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """Parse ``"1..512"`` (the powers of two in that range) or a list ``"8,16,24"``."""
    match = _RANGE.match(text)
    if match:
        lo, hi = int(match.group(1)), int(match.group(2))
        sizes = tuple(2**k for k in range(hi.bit_length() + 1) if lo <= 2**k <= hi)
        if not sizes:
            raise UsageError(f"--batch-sizes {text!r} holds no power of two: widen the range, e.g. 1..512, or list sizes, e.g. 24,48")
        return sizes
    return _int_list(text, "--batch-sizes", "a range such as 1..512 or a list such as 8,16,24", minimum=1)


def parse_precisions(text: str) -> tuple[str, ...] | None:
    """Parse ``"auto"`` (``None``: what the device supports) or a list ``"fp32,bf16"``."""
    if text.strip() == "auto":
        return None
    names = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    refused = next((n for n in names if n in NOT_OFFERED), None)
    if refused is not None:
        raise UsageError(f"--precisions {refused}: {NOT_OFFERED[refused]}")
    unknown = [n for n in names if n not in PRECISION_NAMES]
    if unknown or not names:
        raise UsageError(f"unknown precision {', '.join(unknown) or repr(text)} in --precisions: choose from {', '.join(PRECISION_NAMES)}")
    return names

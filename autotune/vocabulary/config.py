"""A point of the search space (:class:`Config`) and its variant: the configuration but for its batch size."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from autotune.vocabulary.compile import EAGER, parse_compile
from autotune.vocabulary.plan import Plan

__all__ = ["Config", "Variant", "Mode"]


class Mode(NamedTuple):
    """What a variant's plans share (the training state, the kernels' dtypes): its precision and compile mode. A key,
    equal to the plain pair."""

    precision: str
    compile: str


class Variant(NamedTuple):
    """The configurations that differ only in batch size: precision, checkpoint plan and compile mode.

    Memory grows along a line over the batch size within a variant (:mod:`autotune.analysis.memory_model`), and
    the search brackets each variant's limit. ``variant.at(batch_size)`` is one of its configurations.
    """

    precision: str
    plan: str
    compile: str = EAGER

    def at(self, batch_size: int) -> "Config":
        return Config(self.precision, self.plan, batch_size, self.compile)

    def with_plan(self, plan: str) -> "Variant":
        """The same precision and compile mode with another plan."""
        return Variant(self.precision, Plan(plan), self.compile)

    @property
    def mode(self) -> Mode:
        """Its precision and compile mode: what a variant's plans share (the training state, the kernels' dtypes)."""
        return Mode(self.precision, self.compile)

    def __str__(self) -> str:
        return f"{self.precision} segments={self.plan}" + ("" if self.compile == EAGER else f" compile={self.compile}")

    # An eager variant is the (precision, plan) pair variants were before compile was an axis: equal to it and hashed
    # as it, so that code keyed by such pairs (a memory model's lines, a caller's own tables) finds it.
    def _pair(self) -> tuple:
        return (self.precision, self.plan) if self.compile == EAGER else tuple(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple) and not isinstance(other, Variant) and len(other) == 2:
            return self._pair() == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self._pair())


@dataclasses.dataclass(frozen=True, order=True)
class Config:
    """One point of the search space: how a single trial trains."""

    precision: str  # "fp32", "fp16" or "bf16"
    plan: Plan  # the checkpoint plan (autotune.plans): "0" is off, "2", "all", "every2", ...
    batch_size: int  # samples per optimizer step
    compile: str = EAGER  # "none" (eager), or the torch.compile mode the model trains compiled under

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", Plan(self.plan))  # Config("fp32", 2, 8): plan "2"
        if self.compile != EAGER:
            parse_compile(self.compile)  # one of torch.compile's modes, or a UsageError naming them

    @property
    def segments(self) -> Plan:
        """The plan under its name in the JSON and the flags (``--segments``)."""
        return self.plan

    @property
    def compiled(self) -> bool:
        return self.compile != EAGER

    @property
    def variant(self) -> Variant:
        """The configurations that differ from this one only in batch size."""
        return Variant(self.precision, self.plan, self.compile)

    def __str__(self) -> str:
        return f"{self.variant} batch={self.batch_size}"

    def to_dict(self) -> dict[str, Any]:
        """The configuration as the JSON and the trial store name it: precision, segments, batch_size, compile."""
        return {"precision": self.precision, "segments": str(self.plan), "batch_size": self.batch_size,
                "compile": self.compile}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """The inverse of :meth:`to_dict` (a trial's parameters in the store; eager where it says nothing)."""
        return cls(data["precision"], data["segments"], int(data["batch_size"]), data.get("compile") or EAGER)

"""The GPUs a dry run plans for (``--card NAME``): their data sheets' figures, read from ``cards.json``.

The table is data, not code: one entry per card, each with the data sheet its values come from. No torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

from autotune.errors import UsageError

__all__ = ["Card", "cards", "card", "CARDS_FILE"]

CARDS_FILE = pathlib.Path(__file__).with_name("cards.json")
DTYPES = ("fp32", "tf32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class Card:
    """One card's data sheet: dense peak FLOP/s per dtype (None where it has no such unit), memory and links, in
    bytes and bytes per second."""

    name: str  # as --card spells it: lower case, no spaces
    title: str
    capability: tuple[int, int] | None  # CUDA compute capability; None for a card CUDA does not number (ROCm)
    peak_flops: dict[str, float | None]  # dtype -> dense FLOP/s
    memory_bytes: int
    memory_bytes_per_s: float
    host_link: str
    host_link_bytes_per_s: float  # one direction
    nvlink_bytes_per_s: float | None  # the data sheet's total, both directions
    source: str

    def to_dict(self) -> dict[str, Any]:
        """The card as a report records it."""
        return {"name": self.name, "title": self.title, "source": self.source,
                "capability": None if self.capability is None else ".".join(map(str, self.capability)),
                "memory_bytes": self.memory_bytes}


def _card(name: str, row: dict[str, Any]) -> Card:
    capability = row["capability"]
    major, _, minor = (capability or "").partition(".")
    tflops = row["tflops"]
    return Card(name=name, title=row["title"],
                capability=(int(major), int(minor)) if capability else None,
                peak_flops={d: None if tflops.get(d) is None else float(tflops[d]) * 1e12 for d in DTYPES},
                memory_bytes=int(row["memory_gib"] * 2**30), memory_bytes_per_s=float(row["memory_gbs"]) * 1e9,
                host_link=row["host_link"], host_link_bytes_per_s=float(row["host_link_gbs"]) * 1e9,
                nvlink_bytes_per_s=None if row["nvlink_gbs"] is None else float(row["nvlink_gbs"]) * 1e9,
                source=row["source"])


@functools.lru_cache(maxsize=None)
def cards() -> dict[str, Card]:
    """Every card of the table, by name."""
    table = json.loads(CARDS_FILE.read_text())["cards"]
    return {name: _card(name, row) for name, row in table.items()}


def card(name: str) -> Card:
    """The card ``name`` (``--card``); :class:`UsageError` naming every known card where there is none."""
    known = cards()
    found = known.get(name.strip().lower())
    if found is None:
        raise UsageError(f"unknown --card {name!r}: choose one of {', '.join(sorted(known))}")
    return found

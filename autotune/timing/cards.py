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

__all__ = ["Card", "cards", "card", "card_named", "CARDS_FILE"]

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


# How a device's own name (torch.cuda.get_device_name, rocm-smi's) names each card of the table: every word of one of
# the card's spellings in it, the more specific spellings first (an H100 PCIe before any H100, an A100 40GB before the
# 80 GB the A100 SXM4 name does not say)
_SPELLINGS = (("h100-pcie", ("h100", "pcie")), ("h100-sxm", ("h100",)), ("h200", ("h200",)),
              ("a100-40gb", ("a100", "40gb")), ("a100-80gb", ("a100",)), ("l40s", ("l40s",)), ("l4", ("l4",)),
              ("a10g", ("a10g",)), ("rtx3090", ("3090",)), ("rtx4090", ("4090",)), ("v100", ("v100",)),
              ("mi300x", ("mi300x",)))


def card_named(device_name: str) -> str | None:
    """The card of the table a device calls itself ``device_name`` (``"NVIDIA H100 80GB HBM3"``: ``h100-sxm``), or None
    where none is: the GPU a check runs on, held against the card a dry run plans for."""
    words = set(device_name.lower().replace("-", " ").split())
    return next((name for name, spelling in _SPELLINGS if all(w in words for w in spelling)), None)

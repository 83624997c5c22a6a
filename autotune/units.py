"""Parse and format byte sizes ("24GiB", "512MiB", "1.5GB"), and the quantiles tables quote."""

from __future__ import annotations

import math
import re
from typing import Any

from autotune.errors import UsageError

__all__ = ["parse_size", "format_bytes", "quantile"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Return the number of bytes in a size such as ``"24GiB"``, ``"512MiB"`` or ``"1e9"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB) powers
    of 1000; a bare number is bytes.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(
                f"cannot read the size {text!r}: write a number with a unit such as 24GiB, 512MiB or 8GB"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"the size {text!r} must be greater than zero")
    return value


def format_bytes(n: int | float | None) -> str:
    """Format a byte count with a binary unit, e.g. ``1.50 GiB``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def quantile(values: list[float] | list[int], q: float) -> Any:
    """Return the smallest of ``values`` with at least a share ``q`` of them at or below it (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = math.ceil(q * len(ordered) - 1e-9)  # 0.07 * 100 is 7.000000000000001 in floating point: still the 7th
    return ordered[min(len(ordered) - 1, max(0, rank - 1))]

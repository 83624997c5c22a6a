"""Precision modes: fp32, fp16 autocast with a GradScaler, bf16 autocast without one."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import torch

from autotune._log import notice_once
from autotune.errors import UsageError

__all__ = ["PRECISIONS", "PrecisionMode", "get_mode", "supported_precisions", "default_precisions", "slowdown_vs_fp32"]

INIT_LOSS_SCALE = 2.0**16  # the practitioner's starting point: halve on inf/NaN, grow when quiet
SLOW_FACTOR = 8.0  # a mode whose matmuls run this many times slower than fp32 leaves the defaults


@dataclasses.dataclass(frozen=True)
class PrecisionMode:
    """How one precision mode trains: the autocast dtype (None for fp32) and whether it scales the loss."""

    name: str
    autocast_dtype: torch.dtype | None
    uses_scaler: bool

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Return the autocast context for a forward pass on ``device_type`` (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def grad_scaler(self, device_type: str) -> "torch.amp.GradScaler | None":
        """Return a fresh GradScaler starting at 2**16 for fp16, ``None`` for the other modes."""
        if not self.uses_scaler:
            return None
        return torch.amp.GradScaler(device_type, init_scale=INIT_LOSS_SCALE)


PRECISIONS: dict[str, PrecisionMode] = {
    "fp32": PrecisionMode("fp32", None, uses_scaler=False),
    "fp16": PrecisionMode("fp16", torch.float16, uses_scaler=True),
    "bf16": PrecisionMode("bf16", torch.bfloat16, uses_scaler=False),
}


def get_mode(name: str) -> PrecisionMode:
    """Return the :class:`PrecisionMode` called ``name`` ("fp32", "fp16" or "bf16")."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise UsageError(f"unknown precision {name!r}: choose from {', '.join(PRECISIONS)}") from None


def supported_precisions(device: torch.device) -> list[str]:
    """Return the precision modes that ``device`` can train in at all."""
    names = ["fp32"]
    if device.type == "cuda":
        names.append("fp16")
        if torch.cuda.is_bf16_supported():
            names.append("bf16")
        return names
    for name in ("fp16", "bf16"):
        try:
            with torch.autocast(device.type, dtype=PRECISIONS[name].autocast_dtype):
                torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        except Exception:
            continue
        names.append(name)
    return names


@functools.lru_cache(maxsize=None)
def slowdown_vs_fp32(name: str, device_type: str, n: int = 384) -> float:
    """Return how many times slower an ``n`` x ``n`` matmul runs in ``name`` than in fp32 (median of 5)."""
    dtype = PRECISIONS[name].autocast_dtype or torch.float32

    def median_s(dt: torch.dtype) -> float:
        a = torch.randn(n, n, device=device_type).to(dt)
        b = torch.randn(n, n, device=device_type).to(dt)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            a @ b
            if device_type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times[1:])[2]  # the first call warms up kernels and caches

    return median_s(dtype) / median_s(torch.float32)


def default_precisions(device: torch.device) -> list[str]:
    """Return the supported modes that are not pathologically slow on ``device``.

    On CUDA every supported mode is kept. On a CPU, a mode whose matmuls run more than
    ``SLOW_FACTOR`` times slower than fp32 (fp16 on CPUs without native half arithmetic) is left
    out, with a notice; asking for it explicitly still runs it, cut at ``--trial-timeout``.
    """
    names = supported_precisions(device)
    if device.type == "cuda":
        return names
    kept = []
    for name in names:
        factor = 1.0 if name == "fp32" else slowdown_vs_fp32(name, device.type)
        if factor > SLOW_FACTOR:
            notice_once(
                f"{name} matmuls run {factor:.0f}x slower than fp32 on this {device.type}: left out of "
                f"the default precisions (add it with --precisions to measure it anyway)"
            )
            continue
        kept.append(name)
    return kept

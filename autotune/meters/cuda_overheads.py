"""What CUDA holds besides a training step's tensors: cuBLAS workspaces (through the caching allocator) and the CUDA
context (outside it, in NVML's figure). Torch-free; :mod:`autotune.meters.caching_allocator` re-exports these names."""

from __future__ import annotations

__all__ = ["cublas_workspace_bytes", "workspace_trace", "nvml_bytes", "CUDA_CONTEXT_BYTES"]

MiB = 1 << 20

# An assumption, not a measurement: the CUDA context (driver state, the kernels lazy loading has loaded) takes about
# 300-600 MiB per process on recent GPUs; measure it where it matters (NVML's device-used before any tensor).
CUDA_CONTEXT_BYTES = 512 * MiB


def cublas_workspace_bytes(major: int, minor: int = 0) -> int:
    """Return torch's default cuBLAS workspace, in bytes, for a GPU of compute capability ``major.minor``.

    ``parseChosenWorkspaceSize`` (aten/src/ATen/cuda/CublasHandlePool.cpp) with ``CUBLAS_WORKSPACE_CONFIG`` unset:
    ``:4096:8`` (32 MiB) on Hopper and Blackwell (major 9, 10, 12; torch before 2.7 or so: 9.0 only), else
    ``:4096:2:16:8`` (8 MiB + 128 KiB). torch allocates it through the caching allocator (``getNewWorkspace``), one
    per cuBLAS handle and stream, so it counts in allocated and reserved, not only in NVML's figure.
    """
    del minor  # every minor version of those majors
    return 4096 * 1024 * 8 if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def workspace_trace(workspace_bytes: int, *, threads: int = 2) -> list[tuple[int, int]]:
    """Return allocation events for cuBLAS workspaces, to put before a trace (keys -1, -2, ...: a tensor meter's
    are positive). An assumption about where matmuls run: a training step's thread and autograd's CUDA device
    thread (backward) each hold a cuBLAS handle, so ``threads=2``; inference, 1. They are held until the process
    ends."""
    return [(workspace_bytes, -1 - i) for i in range(threads)]


def nvml_bytes(reserved_bytes: int, *, context_bytes: int = CUDA_CONTEXT_BYTES, other_bytes: int = 0) -> int:
    """Return the device memory NVML reports as used, in bytes: what the caching allocator reserved, the CUDA
    context (``context_bytes``: :data:`CUDA_CONTEXT_BYTES` is an assumption, measure it where it matters) and
    ``other_bytes`` (other processes; memory libraries take outside the allocator, such as NCCL's buffers)."""
    return reserved_bytes + context_bytes + other_bytes

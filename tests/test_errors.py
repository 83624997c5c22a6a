"""Recognising out-of-memory errors and device crashes, and the out-of-memory error the tensor meter raises."""


import pytest
import torch

import autotune
from autotune.errors import (
    AutotuneError,
    Interrupted,
    TrialTimeoutError,
    UsageError,
    first_line,
    is_device_crash,
    is_oom,
)
from autotune.meters.oom import BudgetExceededError

from tests.optional import needs

class AcceleratorError(RuntimeError):
    """Named as torch (>= 2.8) names its CUDA errors; the predicate goes by the name."""


def budget_error():
    return BudgetExceededError(requested_bytes=4096, live_bytes=3 * 2**20, budget_bytes=2**22)


# --- is_oom --------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    torch.OutOfMemoryError(),  # no message: recognised by its type
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."),
    RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GB)"),
    budget_error(),
])
def test_is_oom_recognises_out_of_memory(exc):
    assert is_oom(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"),
    RuntimeError(),  # no message at all
    RuntimeError(12),  # a message that is not text
    ValueError("out of memory"),  # not a RuntimeError
    MemoryError("out of memory"),  # Python's own, not PyTorch's
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    KeyboardInterrupt(),
])
def test_is_oom_leaves_other_errors_alone(exc):
    assert not is_oom(exc)


def test_a_later_argument_does_not_make_an_oom():
    assert not is_oom(RuntimeError("shape mismatch", "out of memory"))  # only the message counts


# --- is_device_crash -----------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA driver error: unspecified launch failure"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"),
    RuntimeError("cudaErrorIllegalAddress"),
    AcceleratorError("an illegal memory access was encountered"),
    AcceleratorError(),
    torch.AcceleratorError("CUDA error: misaligned address"),
])
def test_is_device_crash_recognises_a_poisoned_device(exc):
    assert is_device_crash(exc)


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: out of memory"),  # an OOM mentions "CUDA error:" too; it is an outcome, not a crash
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    budget_error(),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
    RuntimeError(),
    ValueError("CUDA error: an illegal memory access was encountered"),  # not a RuntimeError
    KeyError("CUDA error:"),
])
def test_is_device_crash_leaves_ooms_and_ordinary_errors_alone(exc):
    assert not is_device_crash(exc)


# --- first_line ----------------------------------------------------------------------------------


@pytest.mark.parametrize("exc, line", [
    (RuntimeError("first\nsecond\nthird"), "first"),
    (RuntimeError("\n  only line  \n"), "only line"),
    (ValueError(""), "ValueError"),
    (ValueError("   \n "), "ValueError"),
    (KeyboardInterrupt(), "KeyboardInterrupt"),
    (UsageError("--budget 'x' is not a size"), "--budget 'x' is not a size"),
])
def test_first_line(exc, line):
    assert first_line(exc) == line


# --- the exception tree ----------------------------------------------------------------------------


def test_autotune_errors_share_one_root():
    assert issubclass(UsageError, AutotuneError) and issubclass(TrialTimeoutError, AutotuneError)
    report = object()
    exc = Interrupted(report)
    assert isinstance(exc, AutotuneError) and exc.report is report and "run the same command" in str(exc)
    assert not issubclass(AutotuneError, RuntimeError)  # never mistaken for a torch error by the predicates
    assert not is_oom(UsageError("out of memory")) and not is_device_crash(AutotuneError("CUDA error: x"))


# --- BudgetExceededError -------------------------------------------------------------------------


def test_budget_exceeded_is_a_torch_out_of_memory_error_with_one_message_argument():
    exc = budget_error()
    assert isinstance(exc, torch.OutOfMemoryError) and isinstance(exc, RuntimeError)
    assert len(exc.args) == 1 and isinstance(exc.args[0], str)
    assert "DefaultCPUAllocator: can't allocate memory" in exc.args[0]
    assert "4096 bytes" in exc.args[0] and f"({2**22} bytes)" in exc.args[0]
    assert (exc.requested_bytes, exc.live_bytes, exc.budget_bytes) == (4096, 3 * 2**20, 2**22)
    assert is_oom(exc) and not is_device_crash(exc)
    with pytest.raises(torch.OutOfMemoryError):  # what a plain `except torch.OutOfMemoryError` catches
        raise exc


def test_budget_exceeded_is_exported_by_the_package():
    assert autotune.BudgetExceededError is BudgetExceededError


def test_lightning_recognises_it_as_out_of_memory():
    is_oom_error = needs("lightning.pytorch.utilities.memory", "the frameworks extra").is_oom_error

    assert is_oom_error(budget_error())
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_accelerate_reduces_the_batch_size_on_it():
    memory = needs("accelerate.utils.memory", "the frameworks extra")
    find_executable_batch_size, should_reduce_batch_size = memory.find_executable_batch_size, memory.should_reduce_batch_size

    assert should_reduce_batch_size(budget_error())
    assert not should_reduce_batch_size(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))

    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):  # accelerate's own retry loop shrinks the batch until the budget holds
        tried.append(batch_size)
        if batch_size > 16:
            raise BudgetExceededError(requested_bytes=batch_size * 1000, live_bytes=0, budget_bytes=16_000)
        return batch_size

    assert train() <= 16 and tried[0] == 64 and len(tried) >= 2
    assert tried == sorted(tried, reverse=True) and all(b > 16 for b in tried[:-1])

"""The meter contract (autotune.meters.base.Meter), the same tests run against every meter this machine has, as
Optuna's storage tests run against every storage: a region's peak covers what it held, a budget is enforced with an
error PyTorch's out-of-memory handlers recognise (the reading still filled in), each region starts from a fresh peak,
tensors made before a region count once tracked, and nothing of the meter stays in force after its region."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autotune.errors import is_oom
from autotune.meters import TensorMeter
from autotune.meters.allocator import AllocatorMeter
from autotune.meters.base import MemoryReading

MiB = 1 << 20


def _cuda_meter(budget_bytes):
    from autotune.meters.cuda import CudaMeter

    return CudaMeter("cuda", budget_bytes=budget_bytes)


METERS = {
    "tensor": lambda budget_bytes=None: TensorMeter("cpu", budget_bytes=budget_bytes),
    "allocator": lambda budget_bytes=None: AllocatorMeter("cpu", budget_bytes=budget_bytes),
    "cuda": pytest.param(_cuda_meter, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="the CUDA meter needs a GPU")),
}


@pytest.fixture(params=list(METERS.values()), ids=list(METERS))
def make(request):
    """A factory of one meter kind under a budget: the meter, and the device its tensors live on."""
    device = "cuda" if request.node.callspec.id == "cuda" else "cpu"
    return lambda budget_bytes=None: (request.param(budget_bytes=budget_bytes), device)


def test_a_regions_peak_covers_what_it_held_at_once(make):
    meter, device = make()
    with meter.measure() as handle:
        a = torch.ones(2 * MiB // 4, device=device)  # 2 MiB
        b = torch.ones(MiB // 4, device=device)  # 1 MiB beside it
        del a, b
    assert isinstance(handle.reading, MemoryReading)
    assert 3 * MiB <= handle.reading.peak_bytes < 8 * MiB


def test_each_region_starts_from_a_fresh_peak(make):
    meter, device = make()
    with meter.measure() as first:
        big = torch.ones(4 * MiB // 4, device=device)
        del big
    with meter.measure() as second:
        small = torch.ones(MiB // 4, device=device)
        del small
    assert first.reading.peak_bytes >= 4 * MiB and MiB <= second.reading.peak_bytes < first.reading.peak_bytes


def test_tensors_made_before_the_region_count_once_tracked(make):
    meter, device = make()
    weights = torch.ones(2 * MiB // 4, device=device)
    with meter.measure() as handle:
        if hasattr(handle, "track"):  # the CPU's meters; CUDA's counts what the device holds
            handle.track([weights, weights])  # the same tensor twice: counted once
        extra = torch.ones(MiB // 4, device=device)
        del extra
    assert 3 * MiB <= handle.reading.peak_bytes < 5 * MiB


def test_over_its_budget_a_region_raises_what_oom_handlers_catch_and_still_reads(make):
    meter, device = make(budget_bytes=2 * MiB)
    with pytest.raises(Exception) as info:
        with meter.measure() as handle:
            held = [torch.ones(MiB // 4, device=device) for _ in range(4)]  # 4 MiB under a 2 MiB budget
            del held
    assert is_oom(info.value) and isinstance(info.value, torch.OutOfMemoryError)
    assert handle.reading is not None and handle.reading.peak_bytes > 2 * MiB


def test_nothing_of_the_meter_stays_in_force_after_its_region(make):
    meter, device = make(budget_bytes=2 * MiB)
    modes = list(_get_current_dispatch_mode_stack())
    with pytest.raises(torch.OutOfMemoryError):
        with meter.measure():
            torch.ones(4 * MiB // 4, device=device)
    assert list(_get_current_dispatch_mode_stack()) == modes
    after = torch.ones(4 * MiB // 4, device=device)  # over the budget, outside any region: no error
    assert after.numel() == MiB

"""The CUDA meter against a faked ``torch.cuda`` and ``pynvml`` (see tests/fake_cuda.py): runs without a GPU."""

import sys

import pytest
import torch

from autotune.meters import cuda as cuda_meter
from autotune.meters.cuda import CudaMeter
from tests.fake_cuda import STICKY_MESSAGE, FakeCuda, FakeGpu, FakeNvml, GiB, MiB

UUID_A = "58be26a5-7d12-4c3e-9f0a-1b2c3d4e5f60"
UUID_B = "ffc79498-8ff3-c2dc-3b0d-fafd804516ae"
UUID_MIG = "2b4c6d8e-1a3b-5c7d-9e0f-a1b2c3d4e5f6"


@pytest.fixture
def said(monkeypatch):
    """Forget the notices said so far, so that a test sees its own."""
    monkeypatch.setattr("autotune._log._said", set())


@pytest.fixture
def cuda(monkeypatch, said):
    """A 24 GiB fake device, without NVML (``import pynvml`` raises ImportError)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    return FakeCuda(total_bytes=24 * GiB, uuids=(UUID_A,)).install(monkeypatch)


# -- 1. the budget holds inside measure() only ----------------------------------------------------------


def test_constructing_a_meter_changes_no_process_wide_setting(cuda):
    CudaMeter("cuda", budget_bytes=8 * GiB)
    assert cuda.fraction_calls == [] and cuda.fraction is None


def test_the_budget_holds_inside_measure_and_the_previous_fraction_comes_back(cuda):
    meter = CudaMeter("cuda", budget_bytes=8 * GiB)
    with meter.measure():
        assert cuda.fraction == pytest.approx(8 / 24)
    assert cuda.fraction == 1.0  # none was set before: torch's default, the whole card
    cuda.fraction = 0.9  # set by someone else: given back as it was
    with meter.measure():
        assert cuda.fraction == pytest.approx(8 / 24)
    assert cuda.fraction == 0.9


def test_the_previous_fraction_comes_back_when_the_block_raises(cuda):
    cuda.fraction = 0.75
    with pytest.raises(ValueError):
        with CudaMeter("cuda", budget_bytes=8 * GiB).measure():
            raise ValueError("the user's model failed")
    assert cuda.fraction == 0.75


def test_no_budget_or_one_above_the_card_sets_nothing(cuda):
    for budget in (None, 24 * GiB, 30 * GiB):
        with CudaMeter("cuda", budget_bytes=budget).measure():
            pass
    assert cuda.fraction_calls == []


# -- 2. per-step peaks ----------------------------------------------------------------------------------


def test_step_peaks_are_allocated_peaks_since_reset_and_can_fall(cuda):
    with CudaMeter("cuda").measure() as h:
        cuda.allocate(400)  # the caching allocator keeps these 400 bytes reserved from now on
        cuda.free(400)
        steps = []
        for nbytes in (100, 300, 150):
            h.reset_peak()
            cuda.allocate(nbytes)
            cuda.free(nbytes)
            steps.append((h.peak_bytes(), h.peak_reserved_bytes()))
    assert steps == [(100, 400), (300, 400), (150, 400)]
    r = h.reading
    assert (r.peak_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes) == (400, 400, 400)


# -- 3. out-of-memory figures ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, nbytes", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB", 2 * GiB),
    ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total capacity; ...)", 20 * MiB),
    ("CUDA out of memory. Tried to allocate 1.50 KiB. GPU 0 has", 1536),
    ("CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has", 512),
    ("CUDA out of memory. Tried to allocate 1,024.00 GiB. GPU 0", None),  # not torch's format: unknown
    ("CUDA error: out of memory", None),
])
def test_the_failed_allocation_is_read_from_torch_s_message(text, nbytes):
    assert cuda_meter.oom_request_bytes(torch.OutOfMemoryError(text)) == nbytes


def test_an_oom_region_reports_what_it_held_and_the_least_it_needed(cuda):
    error = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which "
        "1.20 GiB is free. Of the allocated memory 21.40 GiB is allocated by PyTorch, and 100.00 MiB is reserved "
        "by PyTorch but unallocated.")
    with pytest.raises(torch.OutOfMemoryError):
        with CudaMeter("cuda").measure() as h:
            cuda.allocate(21 * GiB)
            raise error
    r = h.reading
    assert r.oom_held_bytes == 21 * GiB
    assert r.oom_needed_bytes == 23 * GiB
    assert r.peak_bytes == 23 * GiB  # above the card: the step needs more than it has
    assert r.peak_reserved_bytes == r.peak_allocated_bytes == 21 * GiB


def test_a_budget_oom_reports_needed_bytes_above_the_budget(cuda):
    with pytest.raises(torch.OutOfMemoryError):
        with CudaMeter("cuda", budget_bytes=8 * GiB).measure() as h:
            cuda.allocate(6 * GiB)
            cuda.allocate(4 * GiB)  # 10 GiB: over the budget
    r = h.reading
    assert (r.oom_held_bytes, r.oom_needed_bytes, r.peak_bytes) == (6 * GiB, 10 * GiB, 10 * GiB)
    assert r.peak_bytes > 8 * GiB and r.peak_reserved_bytes == 6 * GiB


def test_an_oom_without_a_size_reports_what_was_held(cuda):
    with pytest.raises(RuntimeError):
        with CudaMeter("cuda").measure() as h:
            cuda.allocate(5 * GiB)
            cuda.free(2 * GiB)
            raise RuntimeError("CUDA error: out of memory")
    r = h.reading
    assert (r.oom_held_bytes, r.oom_needed_bytes) == (5 * GiB, None)  # reserved: the cache counts too
    assert r.peak_bytes == 5 * GiB


def test_a_region_without_oom_has_no_oom_figures(cuda):
    with pytest.raises(ValueError):
        with CudaMeter("cuda").measure() as h:
            cuda.allocate(GiB)
            raise ValueError("not an out-of-memory error")
    assert h.reading.oom_held_bytes is None and h.reading.oom_needed_bytes is None
    assert h.reading.peak_bytes == GiB


# -- 4. a sticky CUDA error is not masked ---------------------------------------------------------------


def test_a_sticky_cuda_error_is_the_error_the_caller_sees(cuda):
    original = torch.AcceleratorError(STICKY_MESSAGE)
    with pytest.raises(torch.AcceleratorError) as info:
        with CudaMeter("cuda", budget_bytes=8 * GiB).measure() as h:
            cuda.allocate(3 * GiB)
            h.reset_peak()  # reads 3 GiB: the figure the reading falls back to
            cuda.allocate(GiB)
            cuda.break_sticky()
            raise original
    assert info.value is original
    r = h.reading
    assert r.peak_bytes == r.peak_reserved_bytes == r.peak_allocated_bytes == 3 * GiB


def test_a_sticky_error_before_anything_was_read_reports_zero(cuda):
    with pytest.raises(KeyError):
        with CudaMeter("cuda").measure() as h:
            cuda.break_sticky()
            raise KeyError("the original")
    assert h.reading.peak_bytes == 0 and h.reading.source == "cuda"


def test_a_cuda_error_after_a_clean_block_propagates(cuda):
    with pytest.raises(torch.AcceleratorError):
        with CudaMeter("cuda").measure():
            cuda.break_sticky()  # the block itself raised nothing: the error surfaces at the meter's sync


# -- 5. the NVML device is the CUDA device, found by UUID -----------------------------------------------


def _nvml_for(monkeypatch, gpus, *, cuda_uuids, lookup_by_uuid="all"):
    FakeCuda(uuids=cuda_uuids).install(monkeypatch)
    nvml = FakeNvml(gpus, lookup_by_uuid=lookup_by_uuid)
    nvml.install(monkeypatch)
    return nvml


def test_a_gpu_is_found_by_its_uuid(monkeypatch, said):
    gpu = FakeGpu(f"GPU-{UUID_A}", used_bytes=5 * GiB)
    _nvml_for(monkeypatch, [gpu], cuda_uuids=(UUID_A,))
    assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is gpu


@pytest.mark.parametrize("lookup_by_uuid", ["all", "none"])
def test_reordered_devices_are_matched_by_uuid_not_index(monkeypatch, said, lookup_by_uuid):
    # CUDA_VISIBLE_DEVICES=1,0: CUDA's device 0 is NVML's device 1 (NVML ignores the variable).
    first, second = FakeGpu(f"GPU-{UUID_A}", used_bytes=GiB), FakeGpu(f"GPU-{UUID_B}", used_bytes=7 * GiB)
    _nvml_for(monkeypatch, [first, second], cuda_uuids=(UUID_B, UUID_A), lookup_by_uuid=lookup_by_uuid)
    assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is second
    assert cuda_meter.nvml_handle(torch.device("cuda", 1)) is first


@pytest.mark.parametrize("lookup_by_uuid", ["all", "gpu", "none"])
def test_a_mig_instance_is_the_mig_device_not_the_card(monkeypatch, said, lookup_by_uuid):
    mig = FakeGpu(f"MIG-{UUID_MIG}", used_bytes=3 * GiB, total_bytes=10 * GiB)
    other = FakeGpu(f"GPU-{UUID_A}", used_bytes=GiB)
    card = FakeGpu(f"GPU-{UUID_B}", used_bytes=20 * GiB, mig={2: mig}, mig_enabled=True)
    _nvml_for(monkeypatch, [other, card], cuda_uuids=(UUID_MIG,), lookup_by_uuid=lookup_by_uuid)
    assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is mig
    with CudaMeter("cuda").measure() as h:
        pass
    assert h.reading.peak_nvml_bytes == 3 * GiB  # the instance's memory, not the card's 20 GiB


def test_no_matching_device_means_no_nvml_figures_and_one_notice(monkeypatch, said, caplog):
    _nvml_for(monkeypatch, [FakeGpu(f"GPU-{UUID_A}", used_bytes=GiB)], cuda_uuids=(UUID_B,))
    with caplog.at_level("WARNING", logger="autotune"):
        assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is None
        assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is None
        with CudaMeter("cuda").measure() as h:
            pass
    assert h.reading.peak_nvml_bytes is None
    notices = [r.message for r in caplog.records if "NVML" in r.message]
    assert len(notices) == 1 and UUID_B in notices[0]


def test_the_parent_uuid_of_a_mig_instance_is_not_taken_for_the_card(monkeypatch, said, caplog):
    # A CUDA runtime that reports the parent GPU's UUID for a MIG instance: CUDA cannot run on a GPU
    # whose MIG mode is on, so the card's figure would be every instance's, not this one's.
    mig = FakeGpu(f"MIG-{UUID_MIG}", used_bytes=3 * GiB, total_bytes=10 * GiB)
    card = FakeGpu(f"GPU-{UUID_B}", used_bytes=20 * GiB, mig={0: mig}, mig_enabled=True)
    _nvml_for(monkeypatch, [card], cuda_uuids=(UUID_B,))
    with caplog.at_level("WARNING", logger="autotune"):
        assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is None
    assert any("MIG" in r.message for r in caplog.records)

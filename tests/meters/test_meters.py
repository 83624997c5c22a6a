import sys
import weakref

import pytest
import torch

from autotune.errors import TrialTimeoutError, is_oom
from autotune.meters import TensorMeter
from autotune.meters import cuda as cuda_meter
from autotune.device import make_meter
from autotune.meters.oom import BudgetExceededError


def test_counts_parameters_gradients_optimizer_state_and_activations():
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters: 4,004,000 bytes
    param_bytes = 4 * 1_001_000
    x_bytes = 4 * 64 * 1000
    with TensorMeter().measure() as h:
        h.track(model.parameters())
        assert h.live_bytes == param_bytes
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 1000)
        loss = model(x).square().mean()
        after_forward = h.live_bytes
        assert after_forward >= param_bytes + x_bytes + 64 * 1000 * 4  # input and output activation
        loss.backward()
        assert h.live_bytes >= after_forward + param_bytes - 64 * 1000 * 8  # gradients, minus freed activations
        opt.step()
        # AdamW keeps two moments per parameter (and a step counter per tensor)
        assert h.live_bytes >= 3 * param_bytes + x_bytes
        del loss, x, opt
    assert h.reading.peak_bytes >= 4 * param_bytes
    assert h.reading.source == "tensor"


def test_views_are_not_counted_twice_and_frees_are_seen():
    with TensorMeter().measure() as h:
        a = torch.zeros(1000)
        base = h.live_bytes
        b = a.view(10, 100)
        c = a[10:]
        assert h.live_bytes == base == 4000
        del a, b, c
        assert h.live_bytes == 0
        d = torch.ones(10) * 2  # the ones tensor is freed once the product exists
        assert h.live_bytes == 40
        del d
    assert h.reading.peak_bytes == 4000  # the peak is the 1000-float tensor


def test_what_an_emulation_keeps_on_the_host_is_never_counted_nor_its_views():
    from autotune.meters.tensor import kept_on_host, meter_aside

    with TensorMeter().measure() as h:
        counted = torch.zeros(100)
        with meter_aside():
            shard = torch.zeros(1000)  # made where the meter did not look, as FSDP2's shards of a PLAN+state
        kept_on_host([shard, counted])  # a counted one leaves the device
        assert h.live_bytes == 0
        flat = shard.view(-1)  # FSDP2 views a fake shard again as it starts: the host's still
        also = shard + 1  # what is computed from it is the device's
        assert h.live_bytes == 4000
        del flat, also, counted
    assert h.reading.peak_bytes == 4000


def test_budget_raises_an_oom_error_that_pytorch_handlers_recognise():
    with pytest.raises(BudgetExceededError) as info:
        with TensorMeter(budget_bytes=10_000).measure():
            torch.zeros(2_000)
            torch.zeros(3_000)
    exc = info.value
    assert isinstance(exc, torch.OutOfMemoryError) and isinstance(exc, RuntimeError)
    assert is_oom(exc)
    # Lightning's is_oom_error and accelerate's should_reduce_batch_size match this text, one argument
    assert len(exc.args) == 1 and "DefaultCPUAllocator: can't allocate memory" in exc.args[0]


def test_a_refused_allocation_is_not_counted_and_the_budget_still_holds_after_it():
    # An out-of-memory handler (accelerate's find_executable_batch_size, Lightning's finder) catches
    # the error and tries again in the same region: the meter must behave like an allocator then.
    with TensorMeter(budget_bytes=10_000).measure() as h:
        kept = torch.zeros(1_000)  # 4,000 bytes
        with pytest.raises(BudgetExceededError):
            torch.zeros(5_000)  # 24,000 bytes asked for
        assert h.live_bytes == 4_000 and h.peak_bytes() == 4_000
        with pytest.raises(BudgetExceededError):
            torch.zeros(2_000)  # 12,000: less than the first attempt, still over the budget
        more = torch.zeros(1_000)  # 8,000 in all: fits
        assert h.live_bytes == 8_000 and h.peak_bytes() == 8_000
        del kept, more
    assert h.reading.peak_bytes == 24_000  # a region that ran out reports the total it asked for


def test_budget_error_surfaces_from_backward():
    model = torch.nn.Sequential(torch.nn.Linear(500, 500), torch.nn.ReLU(), torch.nn.Linear(500, 500))
    meter = TensorMeter(budget_bytes=4 * 500 * 500 * 2 + 4 * 256 * 500 * 4)
    with pytest.raises(torch.OutOfMemoryError):
        with meter.measure() as h:
            h.track(model.parameters())
            model(torch.randn(256, 500)).sum().backward()
    assert h.reading.peak_bytes > meter.budget_bytes


def test_deadline_stops_at_the_next_op():
    import time

    with pytest.raises(TrialTimeoutError):
        with TensorMeter().measure(deadline=time.monotonic() - 1):
            torch.zeros(3)


def test_meter_releases_its_finalisers():
    registry = len(weakref.finalize._registry)
    keep = []
    with TensorMeter().measure():
        keep.append(torch.zeros(10))  # outlives the region
        tmp = torch.zeros(10)
        del tmp
    assert len(weakref.finalize._registry) == registry
    assert keep[0].sum() == 0


def test_make_meter_chooses_by_device():
    assert isinstance(make_meter("cpu"), TensorMeter)
    assert make_meter("cpu", budget_bytes=5).budget_bytes == 5


def test_nvml_absent_means_no_nvml_figures_said_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    monkeypatch.setattr("autotune._log._said", set())
    with caplog.at_level("WARNING", logger="autotune"):
        assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is None
        assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is None
    notices = [r.message for r in caplog.records if "NVML" in r.message]
    assert len(notices) == 1 and "nvidia-ml-py" in notices[0]


def test_nvml_without_a_driver_is_a_notice_not_a_crash(monkeypatch, caplog):
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is a required dependency; install it")
    monkeypatch.setattr("autotune._log._said", set())
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the no-driver path cannot be reached")
    with caplog.at_level("WARNING", logger="autotune"):
        assert cuda_meter.nvml_handle(torch.device("cuda", 0)) is None
    assert any("NVML could not be read" in r.message for r in caplog.records)
    del pynvml


def test_an_oom_region_reports_what_it_held_and_the_least_it_needed():
    with pytest.raises(BudgetExceededError):
        with TensorMeter(budget_bytes=10_000).measure() as h:
            kept = torch.zeros(1_000)  # 4,000 bytes held
            torch.zeros(5_000)  # 20,000 more: 24,000 asked for
    r = h.reading
    assert (r.oom_held_bytes, r.oom_needed_bytes) == (4_000, 24_000)
    assert r.peak_bytes == r.peak_allocated_bytes == 24_000  # as before: the total it asked for
    del kept


def test_a_region_that_recovered_from_oom_has_no_oom_figures():
    with TensorMeter(budget_bytes=10_000).measure() as h:
        with pytest.raises(BudgetExceededError):
            torch.zeros(5_000)
    assert h.reading.oom_held_bytes is None and h.reading.oom_needed_bytes is None
    assert h.reading.peak_bytes == 20_000


def test_the_tensor_meter_has_no_reserved_figure():
    with TensorMeter().measure() as h:
        torch.zeros(10)
        assert h.peak_reserved_bytes() is None


def test_a_dtensors_local_shard_is_counted_though_dtensor_made_it_below_the_meter(one_rank_group):
    # DTensor runs each op on its local tensors inside its own dispatch, where the meter's mode is off: FSDP2's
    # optimizer state (AdamW's moments over the sharded parameters) was counted nowhere before
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(DTensor.from_local(torch.randn(1000), mesh, [Shard(0)]))
    with TensorMeter().measure() as h:
        state = torch.zeros_like(param)
        assert h.live_bytes == 4000
        moved = state * 2
        assert h.live_bytes == 8000
        del state, moved
        assert h.live_bytes == 0
        param.grad = torch.ones_like(param)
        opt = torch.optim.AdamW([param])
        opt.step()
        assert h.live_bytes >= 3 * 4000  # the gradient and the two moments


def test_a_storage_resized_in_place_is_counted_at_its_new_size_and_held_to_the_budget():
    # FSDP2 frees each gathered block with storage.resize_(0) and gathers into it again: no op a dispatch mode sees
    with TensorMeter(budget_bytes=6000).measure() as h:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)
        assert h.live_bytes == 0
        t.untyped_storage().resize_(4000)
        assert h.live_bytes == 4000
        with pytest.raises(BudgetExceededError):
            t.untyped_storage().resize_(8000)  # refused as an allocator would: the storage keeps its size
        assert t.untyped_storage().nbytes() == 4000 and h.live_bytes == 4000 and h.peak_bytes() == 4000
        del t
        assert h.live_bytes == 0
    assert h.reading.peak_bytes == 8000  # a region that ran out reports the total it asked for
    assert "resize_" not in torch.UntypedStorage.__dict__  # torch's own method again outside the region


def test_a_meter_says_what_it_can_do_instead_of_being_known_by_name():
    from autotune.meters.base import Meter, MemoryReading

    assert TensorMeter.predicted_exactly and not TensorMeter.sees_compiled and TensorMeter.slows_steps
    assert not Meter.predicted_exactly and MemoryReading(peak_bytes=3).peak_allocated_bytes is None

"""The device backend: the CPU for real; CUDA's branches against a faked torch.cuda."""

import gc
import weakref

import pytest
import torch

from autotune import device as device_module
from autotune.device import Backend, CudaBackend, backend_for, resolve_device
from autotune.errors import UsageError


def test_the_cpu_backend_measures_with_the_tensor_meter_in_this_process():
    backend = backend_for("cpu")
    assert type(backend) is Backend and backend.default_isolation == "none" and backend.meter_name == "TensorMeter"
    assert backend.meter(budget_bytes=2**20).slows_steps and backend.kind == "cpu"
    assert backend.total_bytes() > 2**30
    assert backend.timed(lambda: torch.ones(64, 64) @ torch.ones(64, 64)) > 0


def test_cpu_supports_fp32_and_bf16():
    assert {"fp32", "bf16"} <= set(backend_for("cpu").supported_precisions())


def test_slowdown_is_measured():
    assert 0 < device_module.slowdown_vs_fp32("bf16", "cpu") < 1000


def test_a_pathologically_slow_mode_leaves_the_defaults_with_a_notice(monkeypatch, caplog):
    # This CPU's fp16 speed is what it is; the decision is tested against a slowdown it would report elsewhere.
    monkeypatch.setattr(device_module, "slowdown_vs_fp32", lambda name, device_type: 40.0 if name == "fp16" else 1.5)
    monkeypatch.setattr("autotune._log._said", set())
    with caplog.at_level("WARNING", logger="autotune"):
        names = backend_for("cpu").default_precisions()
    assert "fp16" not in names and "fp32" in names
    assert any("fp16 matmuls run 40x slower" in r.message and "--precisions" in r.message for r in caplog.records)


def test_bad_devices_are_usage_errors(monkeypatch):
    with pytest.raises(UsageError, match="not a device"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="no CUDA GPU"):
        resolve_device("cuda")
    assert resolve_device(None) == torch.device("cpu")


def _fake_gpu(monkeypatch, capability, *, hip=None):
    """A torch.cuda that answers as a GPU of ``capability`` would; is_bf16_supported as torch writes it."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or capability[0] >= 8)


@pytest.mark.parametrize("capability, hip, bf16", [((7, 0), None, False), ((7, 5), None, False), ((8, 0), None, True),
                                                   ((9, 0), None, True), ((9, 4), "6.2", True)])
def test_bf16_is_offered_on_gpus_that_have_it_not_on_those_that_emulate_it(monkeypatch, capability, hip, bf16):
    # Volta and Turing emulate bf16 (slowly; cuDNN has no bf16 convolutions there): the default
    # torch.cuda.is_bf16_supported() says True for them.
    _fake_gpu(monkeypatch, capability, hip=hip)
    names = CudaBackend(torch.device("cuda", 0)).supported_precisions()
    assert names[:2] == ["fp32", "fp16"] and ("bf16" in names) is bf16


def test_cuda_release_collects_cycles_before_emptying_the_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(device_module.gc, "collect", lambda *a: calls.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    CudaBackend(torch.device("cuda", 0)).release()
    assert calls == ["gc.collect", "synchronize", "empty_cache"]


def test_cuda_release_after_a_sticky_error_does_not_raise_over_it(monkeypatch):
    def sticky(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky)
    monkeypatch.setattr(torch.cuda, "empty_cache", sticky)
    CudaBackend(torch.device("cuda", 0)).release()  # the trial has recorded the first error; this one is not raised


def test_release_frees_a_model_held_in_a_reference_cycle():
    class Cyclic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.me = [self]  # as Hugging Face models and --fp32-modules wrappers hold themselves

    gc.disable()  # only the backend may collect the cycle
    try:
        model = Cyclic()
        alive = weakref.ref(model)
        del model
        assert alive() is not None  # refcounting alone does not free a cycle
        backend_for("cpu").release()
        assert alive() is None
    finally:
        gc.enable()


def test_the_cuda_budget_is_a_context_manager_that_puts_the_fraction_back(monkeypatch):
    fractions = [0.75]  # a fraction some other code set before
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 8 * 2**30}))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fractions[-1], raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append(f))
    backend = CudaBackend(torch.device("cuda", 0))
    with backend.budget(2 * 2**30):
        assert fractions[-1] == 0.25
    assert fractions == [0.75, 0.25, 0.75]
    with backend.budget(None), Backend(torch.device("cpu")).budget(2**30):
        assert fractions == [0.75, 0.25, 0.75]  # no budget, and the CPU's: nothing process-wide


# --- what a warm worker checks between two trials (autotune.execution.spawn) --------------------------------------


def test_the_cpu_counts_each_storage_it_holds_once_and_leaves_out_what_is_kept():
    backend = backend_for("cpu")
    before = backend.held_bytes()
    held = torch.zeros(1 << 18)  # 1 MiB
    views = [held[:10], held.view(512, 512), held]  # one storage, seen four times
    assert backend.held_bytes() - before == 1 << 20
    kept = torch.zeros(1 << 16)  # 256 KiB
    assert backend.held_bytes([kept]) - before == 1 << 20  # the workload's kept model is not the trial's
    assert backend.held_bytes([held]) - before == 1 << 18
    del held, views, kept
    assert backend.held_bytes() == before


def test_the_cuda_backend_counts_the_allocator_after_handing_its_cache_back(monkeypatch):
    from tests.fake_cuda import FakeCuda, MiB

    fake = FakeCuda().install(monkeypatch)
    cleared = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True), raising=False)
    fake.allocate(10 * MiB)
    fake.free(4 * MiB)  # cached, not allocated
    assert CudaBackend(torch.device("cuda", 0)).held_bytes() == 6 * MiB
    assert cleared == [True]  # cuBLAS's workspaces go back first: the next trial's peak counts them, as a fresh process's
    assert (fake.reserved_bytes, fake.peak_allocated_bytes) == (6 * MiB, 6 * MiB)
    # the allocator counts every block, those of tensors frozen out of Python's collector too: a warm worker adds
    # nothing for them (the CPU's scan cannot see frozen tensors, so there the worker adds their bytes)
    assert not CudaBackend.held_by_scan and Backend.held_by_scan

"""The allocator meter: peaks summed from the CPU allocator's own events, which also see code torch.compile generated.

A cold CPU compile costs seconds here: the module compiles one small MLP once (a module-scoped fixture, its inductor
cache in a temporary directory) and reads the compiled assertions from it.
"""

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from autotune.errors import UsageError, is_oom
from autotune.examples import ResNetish, TinyGPT
from autotune.meters import AllocatorMeter, TensorMeter
from autotune.meters.oom import BudgetExceededError

from tests.inductor import cheap_inductor
from tests.paths import ROOT

GPT = {"n_layer": 2, "n_embd": 64, "block_size": 64}
RESNET = {"depth": 2, "channels": 16, "image_size": 16}
BATCH = 8


def _example(name: str):
    """A fresh example model, what exists of it before a region (parameters, buffers, a batch) and its loss."""
    torch.manual_seed(0)
    if name == "gpt":
        model = TinyGPT(**GPT)
        batch = model.example_batch(BATCH)
        return model, [*model.parameters(), *model.buffers(), *batch.values()], lambda: model(**batch).loss
    model = ResNetish(**RESNET)
    images, labels = model.example_batch(BATCH)
    return model, [*model.parameters(), *model.buffers(), images, labels], lambda: model.loss(model(images), labels)


def _train(meter, name: str, handles: list | None = None):
    """Two AdamW steps of an example model in one region of ``meter`` (its state made in the first, held in the
    second); return the handle, also put in ``handles`` for a region that raises."""
    model, before, loss = _example(name)
    with meter.measure() as h:
        if handles is not None:
            handles.append(h)
        h.track(before)
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            loss().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return h


def test_counts_from_zero_with_tracked_tensors_once_and_frees_seen():
    """A region counts what it allocates and what it is given to track, each storage once, until it is freed."""
    model = torch.nn.Linear(100, 100)  # 10,100 parameters: 40,400 bytes, made before the region
    with AllocatorMeter().measure() as h:
        h.track([*model.parameters(), model.weight.view(-1), model.weight.t()])  # views share their storage
        assert h.live_bytes == 40_400
        made = torch.zeros(250)  # 1,000 bytes the allocator reports; tracking it again counts nothing more
        h.track([made])
        assert h.live_bytes == 41_400
        del model  # the tracked parameters are freed: their finaliser uncounts them
        assert h.live_bytes == 1_000
        d = torch.ones(10) * 2  # the ones tensor is freed once the product exists
        assert h.live_bytes == 1_040
        del made, d
        assert h.live_bytes == 0
    assert h.reading.peak_bytes == h.reading.peak_allocated_bytes == 41_400
    assert h.reading.source == "allocator" and h.reading.peak_reserved_bytes is None


def test_memory_from_before_the_region_freed_inside_it_does_not_lower_the_count():
    """A block allocated before any profiling is freed unreported; one allocated while an earlier region profiled is
    reported freed. Neither was counted in this region, so neither may be taken off its count."""
    unseen = torch.zeros(1_000)
    with AllocatorMeter().measure():
        earlier = torch.zeros(2_000)
    with AllocatorMeter().measure() as h:
        kept = torch.zeros(500)  # 2,000 bytes
        del unseen, earlier
        assert h.live_bytes == 2_000
    assert h.reading.peak_bytes == 2_000
    del kept


def test_peaks_per_part_and_the_budget_judged_when_the_events_are_read():
    """The probe's pattern, reset_peak() before a step and peak_bytes() after it: each read stops the profiler, starts
    it again, and judges the budget on the events it read."""
    with AllocatorMeter(budget_bytes=30_000).measure() as h:
        a = torch.zeros(5_000)  # 20,000 bytes
        assert h.peak_bytes() == 20_000
        del a
        h.reset_peak()
        assert h.peak_bytes() == 0
        b = torch.zeros(2_000)  # 8,000 bytes
        assert h.peak_bytes() == 8_000
        c = torch.zeros(6_000)  # 24,000 more: 32,000 held, past the budget; nothing refuses it while it runs
        with pytest.raises(BudgetExceededError):
            h.peak_bytes()
        del b, c
    r = h.reading  # the region went on after the error was caught: a region that recovered has no oom figures
    assert r.peak_bytes == 32_000 and r.oom_held_bytes is None and r.oom_needed_bytes is None


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_agrees_with_the_tensor_meter_on_eager_training(name):
    """Both meters see the same step; the allocator also sees what ops allocate and no op returns. Measured on torch
    2.13 under the full profiler, which names the op around each allocation, with a dispatch mode noting the address
    of every op's output as it was made: the blocks no output explains are these.

    TinyGPT: 16 bytes more, exactly. Each attention layer scales its scores by a Python float, which the argument
    parser wraps in a 0-dim float64 tensor (8 bytes) that is no op's output; autograd saves it for MulBackward0
    until the backward pass. ResNetish: oneDNN's own buffers inside ``aten::convolution_backward``: two
    activation-sized ones (8 x 16 x 16 x 16 fp32, 131,072 bytes each) and a scratchpad. With one thread they are
    live while the activations are below their peak and the peaks differ by the scratchpad, 576 bytes (0.04%); with
    two threads by 140,416 (8.7%): one activation-sized buffer and 9,344 bytes of per-thread weight gradients, and
    1,024 bytes more with each further thread.
    """
    allocator = _train(AllocatorMeter(), name).reading.peak_bytes
    tensor = _train(TensorMeter(), name).reading.peak_bytes
    if name == "gpt":
        assert 0 <= allocator - tensor <= 1024, (allocator, tensor)
    else:
        activation = BATCH * RESNET["channels"] * RESNET["image_size"] ** 2 * 4
        assert 0 <= allocator - tensor <= activation + 16 * 1024 * torch.get_num_threads(), (allocator, tensor)


def test_a_budget_below_the_peak_is_an_oom_error_when_the_region_ends_and_one_at_it_is_not():
    """The budget is judged on the events after the fact: one byte below the peak fails, the peak itself fits."""
    peak = _train(AllocatorMeter(), "gpt").reading.peak_bytes
    assert _train(AllocatorMeter(budget_bytes=peak), "gpt").reading.peak_bytes == peak
    handles = []
    with pytest.raises(torch.OutOfMemoryError) as info:
        _train(AllocatorMeter(budget_bytes=peak - 1), "gpt", handles)
    assert is_oom(info.value) and isinstance(info.value, BudgetExceededError)
    # Judged after the fact: the region ran to its end, so the reading has its whole peak, and the allocation that
    # crossed the budget (the one a real allocator with this budget would have refused)
    r = handles[0].reading
    assert r.peak_bytes == peak and r.oom_held_bytes <= peak - 1 < r.oom_needed_bytes <= peak


def test_the_reading_is_filled_when_the_block_raises_and_the_profiler_is_stopped():
    """A block's own error is the region's: the reading is filled and the profiler stopped behind it."""
    with pytest.raises(ValueError):
        with AllocatorMeter(budget_bytes=1_000).measure() as h:
            kept = torch.zeros(1_000)  # 4,000 bytes: past the budget, but the block's own error is what propagates
            raise ValueError("the user's code failed")
    assert h.reading.peak_bytes == 4_000 and h.reading.oom_held_bytes is None
    assert not torch.autograd._profiler_enabled()
    del kept


def test_an_oom_region_reports_what_it_held_and_the_least_it_needed():
    """Held and needed are those of the first allocation past the budget; the peak is the region's, higher."""
    with pytest.raises(BudgetExceededError):
        with AllocatorMeter(budget_bytes=10_000).measure() as h:
            kept = torch.zeros(1_000)  # 4,000 bytes held
            torch.zeros(5_000)  # 20,000 more: 24,000, the first allocation past the budget
            torch.zeros(6_000)  # 28,000: the peak, past it again
    r = h.reading
    assert (r.oom_held_bytes, r.oom_needed_bytes, r.peak_bytes) == (4_000, 24_000, 28_000)
    del kept


def test_the_profiler_is_the_meters_alone():
    """A region refuses to start under a running profiler, and fails when one is started inside it (torch lets a second
    profiler replace the first, and both lose their events)."""
    with profile(activities=[ProfilerActivity.CPU]):
        with pytest.raises(UsageError, match="already running"):
            with AllocatorMeter().measure():
                pass
    with pytest.raises(UsageError, match="inside an allocator meter's region"):
        with AllocatorMeter().measure():
            with profile(activities=[ProfilerActivity.CPU]):
                torch.zeros(10)
    assert not torch.autograd._profiler_enabled()


def test_only_the_cpu_and_finalisers_released():
    """The meter reads the CPU allocator only; a tracked tensor that outlives the region keeps no finaliser of it."""
    with pytest.raises(UsageError, match="CPU allocator"):
        AllocatorMeter("meta")
    registry = len(weakref.finalize._registry)
    keep = torch.zeros(10)
    with AllocatorMeter().measure() as h:
        h.track([keep])  # outlives the region
    assert len(weakref.finalize._registry) == registry and h.reading.peak_bytes == 40


def test_kineto_prints_nothing_and_the_environment_is_left_as_it_was():
    """Kineto reads its log level at a process's first profiler start: a fresh interpreter shows what a user sees."""
    code = ("import os, torch\nfrom autotune.meters import AllocatorMeter\n"
            "with AllocatorMeter().measure():\n    torch.zeros(10)\n"
            "with AllocatorMeter().measure():\n    torch.zeros(10)\n"
            "assert 'KINETO_LOG_LEVEL' not in os.environ\n")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "profiler_start" not in out.stderr and "USDT" not in out.stderr, out.stderr


IN, HIDDEN, ROWS = 32, 8192, 512  # the hidden activation, ROWS x HIDDEN fp32: 16 MiB, most of the step


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """A two-layer MLP, its batch, and its loss eager and compiled (compiled once here, outside any meter)."""
    with cheap_inductor(tmp_path_factory.mktemp("inductor-cache")):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))
        x = torch.randn(ROWS, IN)

        def loss():
            return model(x).square().mean()

        compiled = torch.compile(loss)
        compiled().backward()
        model.zero_grad(set_to_none=True)
        yield model, x, loss, compiled
    torch._dynamo.reset()


def _sgd_step(meter, model, x, loss) -> int:
    """One SGD step (no optimizer state) in a region of ``meter``, the parameters and batch tracked; its peak."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with meter.measure() as h:
        h.track([*model.parameters(), x])
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return h.reading.peak_bytes


def test_a_compiled_step_is_seen_and_the_tensor_meter_measures_an_eager_one_instead(mlp):
    """Why this meter exists: the tensor meter cannot measure a compiled step, and this one can."""
    model, x, eager, compiled = mlp
    held = 2 * sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4  # parameters, gradients, batch
    activation = ROWS * HIDDEN * 4
    seen = _sgd_step(AllocatorMeter(), model, x, compiled)
    # The compiled forward saves the ReLU's output for the second layer's weight gradient: the generated code
    # allocates it with empty_strided_cpu, below the dispatcher, and the allocator meter sees it.
    assert seen - held >= activation
    # Under a dispatch mode (the tensor meter's) dynamo does not run compiled code: the function runs eagerly, so the
    # tensor meter reports the eager step's figure (the allocator meter's for the eager step, as on eager models)...
    assert _sgd_step(TensorMeter(), model, x, compiled) == _sgd_step(TensorMeter(), model, x, eager)
    eager_seen = _sgd_step(AllocatorMeter(), model, x, eager)
    assert eager_seen == _sgd_step(TensorMeter(), model, x, eager)
    # ...which is not the compiled step's: eager code holds a third activation-sized buffer in the backward pass
    # (the ReLU's gradient beside its input gradient), where the generated code computes one in place of the other.
    assert seen <= eager_seen - activation // 2, (seen, eager_seen)

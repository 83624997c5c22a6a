"""The CUDA caching allocator's model, rule by rule with bytes computed by hand, and the tensor meter's trace."""

import importlib.util
import pathlib
import random
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.execution.cuda_rules import CudaRules
from autotune.meters import TensorMeter
from autotune.meters.caching_allocator import (CUDA_CONTEXT_BYTES, AllocatorOutOfMemory, AllocatorSettings,
                                               CachingAllocator, cublas_workspace_bytes, nvml_bytes, replay,
                                               round_size, segment_size, workspace_trace)
from autotune.meters.oom import BudgetExceededError
from autotune.meters.tensor import leave_device, passing_peak
from autotune.training.workload import Workload
from tests.test_house import _python
from tests.paths import ROOT

KiB, MiB = 1 << 10, 1 << 20
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def events(*steps):
    """A trace from ``+size`` (an allocation under the next key) and ``-k`` (the free of the k-th allocation)."""
    trace, sizes = [], []
    for kind, amount in steps:
        if kind == "+":
            sizes.append(amount)
            trace.append((amount, len(sizes)))
        else:
            trace.append((-sizes[amount - 1], amount))
    return trace


# -- rounding and segment sizes ------------------------------------------------------------------------------


def test_requests_are_rounded_to_512_bytes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]


def test_segment_sizes_by_request():
    assert segment_size(512) == segment_size(1 * MiB) == 2 * MiB  # the small pool's 2 MiB
    assert segment_size(1 * MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB a segment of its own
    assert segment_size(25 * MiB) == 26 * MiB  # rounded up to 2 MiB
    assert segment_size(3 * MiB, large_segment_bytes=64 * MiB) == 64 * MiB  # large_segment_size_mb


# -- one rule at a time --------------------------------------------------------------------------------------


def test_a_small_allocation_takes_one_2_mib_segment():
    r = replay(events(("+", 100)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.peak_requested_bytes, r.segments) == (512, 2 * MiB, 100, 1)


def test_two_600_kib_allocations_share_a_2_mib_segment_and_a_third_needs_another():
    r = replay(events(("+", 600 * KiB), ("+", 600 * KiB)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segments) == (1200 * KiB, 2 * MiB, 1)
    r = replay(events(("+", 600 * KiB), ("+", 600 * KiB), ("+", 600 * KiB), ("+", 600 * KiB)))
    assert (r.peak_reserved_bytes, r.segments) == (4 * MiB, 2)  # 3 x 600 KiB fill 1800 of the first 2048 KiB


def test_a_3_mib_allocation_takes_a_20_mib_segment_and_the_next_reuses_its_remainder():
    r = replay(events(("+", 3 * MiB), ("+", 3 * MiB)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segments) == (6 * MiB, 20 * MiB, 1)


def test_a_25_mib_request_reserves_26_mib_and_its_block_is_allocated_whole():
    r = replay(events(("+", 25 * MiB)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.peak_requested_bytes) == (26 * MiB, 26 * MiB, 25 * MiB)


def test_a_large_block_is_not_split_for_a_remainder_of_1_mib_or_less():
    # 3 MiB from a 20 MiB segment leaves 17 MiB; 16.5 MiB of it leaves 0.5 MiB: not split, all 17 MiB allocated
    r = replay(events(("+", 3 * MiB), ("+", 16 * MiB + 512 * KiB)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segments) == (20 * MiB, 20 * MiB, 1)
    # in the small pool 512 bytes are worth splitting off: 1 MiB + 1 MiB - 512 fill one segment, 512 more fit
    r = replay(events(("+", 1 * MiB), ("+", 1 * MiB - 512), ("+", 512)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes) == (2 * MiB, 2 * MiB)


def test_free_then_allocate_again_reuses_the_cached_block():
    r = replay(events(("+", 30 * MiB), ("-", 1), ("+", 30 * MiB), ("-", 2), ("+", 100), ("-", 3), ("+", 100)))
    assert (r.peak_reserved_bytes, r.reserved_bytes, r.segments, r.allocated_bytes) == (32 * MiB, 32 * MiB, 2, 512)


def test_a_freed_block_merges_with_its_free_neighbours():
    # two 3 MiB blocks freed back into their 20 MiB segment make it whole again: 15 MiB fits in it
    r = replay(events(("+", 3 * MiB), ("+", 3 * MiB), ("-", 1), ("-", 2), ("+", 15 * MiB)))
    assert (r.peak_reserved_bytes, r.segments) == (20 * MiB, 1)


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    # free blocks of 12 and 16 MiB: 11 MiB goes to the 12, so 15 MiB still finds the 16
    r = replay(events(("+", 12 * MiB), ("+", 16 * MiB), ("-", 1), ("-", 2), ("+", 11 * MiB), ("+", 15 * MiB)))
    assert (r.peak_reserved_bytes, r.segments) == (28 * MiB, 2)


def test_fragmentation_free_bytes_in_two_segments_cannot_serve_one_request():
    # 24 MiB cached, but in two 12 MiB segments that never merge: 14 MiB needs a segment of its own
    r = replay(events(("+", 12 * MiB), ("+", 12 * MiB), ("-", 1), ("-", 2), ("+", 14 * MiB)))
    assert (r.peak_reserved_bytes, r.allocated_bytes, r.segments) == (38 * MiB, 14 * MiB, 3)


def test_zero_byte_requests_allocate_nothing():
    r = replay([(0, 1), (100, 2), (0, 1), (-100, 2)])
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.allocated_bytes) == (512, 2 * MiB, 0)
    allocator = CachingAllocator()
    allocator.malloc(7, 0)
    allocator.free(7)
    assert allocator.summary().peak_reserved_bytes == 0


# -- out of memory: the cache given back, then one more try --------------------------------------------------


def test_a_failed_allocation_frees_cached_segments_and_retries():
    trace = events(("+", 12 * MiB), ("-", 1), ("+", 30 * MiB))  # 12 cached + 30 new = 42 MiB
    assert replay(trace).peak_reserved_bytes == 42 * MiB
    r = replay(trace, capacity_bytes=40 * MiB)
    assert (r.peak_reserved_bytes, r.reserved_bytes, r.segments, r.retries, r.oom) == (30 * MiB, 30 * MiB, 1, 1, False)


def test_a_split_segment_in_use_is_not_given_back():
    # the 20 MiB segment of a live 3 MiB block keeps its 17 MiB free remainder; only the free 18 MiB segment goes
    trace = events(("+", 3 * MiB), ("+", 18 * MiB), ("-", 2), ("+", 20 * MiB))  # 20 + 18 cached + 20 new = 58 MiB
    r = replay(trace, capacity_bytes=40 * MiB)
    assert (r.reserved_bytes, r.segments, r.retries, r.oom) == (40 * MiB, 2, 1, False)


def test_an_allocation_that_fails_after_the_retry_is_the_runs_oom():
    trace = events(("+", 12 * MiB), ("+", 30 * MiB), ("+", 100))
    r = replay(trace, capacity_bytes=40 * MiB)
    assert r.oom and r.oom_request_bytes == 30 * MiB  # torch's "Tried to allocate 30.00 MiB"
    assert (r.reserved_bytes, r.allocated_bytes, r.retries) == (12 * MiB, 12 * MiB, 1)  # the replay stopped there


def test_max_split_size_keeps_oversize_blocks_whole_and_frees_one_before_the_retry():
    split = AllocatorSettings(max_split_bytes=40 * MiB)
    trace = events(("+", 50 * MiB), ("-", 1), ("+", 12 * MiB))
    assert replay(trace).peak_reserved_bytes == 50 * MiB  # unlimited: 12 MiB is cut from the cached 50
    assert replay(trace, settings=split).peak_reserved_bytes == 62 * MiB  # an oversize block is not cut for it
    r = replay(trace, settings=split, capacity_bytes=60 * MiB)  # release_available_cached_blocks frees the 50
    assert (r.reserved_bytes, r.peak_reserved_bytes, r.retries) == (12 * MiB, 50 * MiB, 0)


# -- expandable segments: pages of 2 MiB (small pool) and 20 MiB (large pool) --------------------------------


def test_expandable_segments_map_pages_as_needed():
    r = replay(events(("+", 600 * KiB), ("+", 600 * KiB)), settings=EXPANDABLE)
    assert (r.peak_reserved_bytes, r.segments) == (2 * MiB, 1)
    r = replay(events(("+", 25 * MiB)), settings=EXPANDABLE)  # two 20 MiB pages, not a 26 MiB segment
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.segments) == (25 * MiB, 40 * MiB, 1)
    r = replay(events(("+", 25 * MiB), ("+", 25 * MiB)), settings=EXPANDABLE)  # 15 MiB left, one page more
    assert (r.peak_reserved_bytes, r.segments) == (60 * MiB, 1)


def test_expandable_segments_merge_what_separate_segments_could_not():
    trace = events(("+", 12 * MiB), ("+", 12 * MiB), ("+", 12 * MiB), ("-", 1), ("-", 2), ("+", 24 * MiB))
    assert replay(trace).peak_reserved_bytes == 60 * MiB  # 3 x 12 MiB segments, then a 24 MiB one
    assert replay(trace, settings=EXPANDABLE).peak_reserved_bytes == 40 * MiB  # 36 MiB in 2 pages; 24 MiB freed merge


def test_expandable_segments_unmap_free_pages_before_the_retry():
    trace = events(("+", 30 * MiB), ("-", 1), ("+", 50 * MiB))
    r = replay(trace, settings=EXPANDABLE, capacity_bytes=60 * MiB)  # 40 mapped + 50 asked > 60: unmap, then 60
    assert (r.reserved_bytes, r.peak_reserved_bytes, r.retries, r.segments, r.oom) == (60 * MiB, 60 * MiB, 1, 1, False)
    r = replay(trace, settings=EXPANDABLE, capacity_bytes=40 * MiB)
    assert r.oom and (r.reserved_bytes, r.segments) == (0, 0)


# -- streams: a stream's segments and free blocks are its own ------------------------------------------------


def test_a_block_freed_on_one_stream_is_reused_only_there():
    allocator = CachingAllocator()
    allocator.malloc(1, 3 * MiB, stream=0)
    allocator.free(1)  # a free 20 MiB segment of stream 0's
    allocator.malloc(2, 3 * MiB, stream=7)  # stream 7 cannot take it: a segment of its own
    assert (allocator.reserved, allocator.segments) == (40 * MiB, 2)
    allocator.malloc(3, 3 * MiB, stream=0)  # stream 0 takes its own back
    assert (allocator.reserved, allocator._live[3].address, allocator._live[3].stream) == (40 * MiB, 0, 0)


def test_empty_cache_gives_back_every_streams_free_segments():
    allocator = CachingAllocator()
    for key, stream in ((1, 0), (2, 7), (3, 9)):
        allocator.malloc(key, 12 * MiB, stream=stream)
    allocator.free(1)
    allocator.free(3)
    allocator.release_cached()
    assert (allocator.reserved, allocator.segments) == (12 * MiB, 1)


def test_max_split_size_gives_back_an_oversize_block_of_the_requests_stream():
    allocator = CachingAllocator(AllocatorSettings(max_split_bytes=40 * MiB), capacity_bytes=100 * MiB)
    allocator.malloc(1, 50 * MiB, stream=7)
    allocator.malloc(2, 45 * MiB, stream=0)  # a 46 MiB segment
    allocator.free(1)
    allocator.free(2)
    allocator.malloc(3, 12 * MiB, stream=0)  # 96 + 12 > 100: stream 0's oversize 46 MiB goes, stream 7's 50 stays
    assert (allocator.reserved, allocator.segments, allocator.retries) == (62 * MiB, 2, 0)


def test_expandable_segments_are_one_per_stream():
    allocator = CachingAllocator(EXPANDABLE)
    allocator.malloc(1, 3 * MiB, stream=0)
    allocator.malloc(2, 3 * MiB, stream=7)  # 17 MiB are free in stream 0's page, none of them stream 7's
    assert (allocator.reserved, allocator.segments) == (40 * MiB, 2)


def test_random_traces_keep_segments_whole_and_the_counts_true():
    """Every segment is a chain of blocks end to end of one stream's, free neighbours of one mapping always merged,
    reserved the mapped bytes and allocated the live blocks', through frees, out-of-memory retries and empty_cache."""
    for seed, settings in enumerate((AllocatorSettings(), EXPANDABLE, AllocatorSettings(max_split_bytes=64 * MiB))):
        rnd = random.Random(seed)
        allocator, live = CachingAllocator(settings, capacity_bytes=300 * MiB), []
        for key in range(1, 400):
            if live and rnd.random() < 0.48:
                allocator.free(live.pop(rnd.randrange(len(live))))
            elif rnd.random() < 0.02:
                allocator.release_cached()
            else:
                try:
                    allocator.malloc(key, rnd.choice([rnd.randint(1, MiB), rnd.randint(MiB, 12 * MiB),
                                                      rnd.randint(10 * MiB, 90 * MiB)]), stream=rnd.choice((0, 7)))
                    live.append(key)
                except AllocatorOutOfMemory:
                    pass
            _check_segments(allocator)


def _check_segments(allocator):
    blocks = set(allocator._live.values())
    for small in (True, False):
        blocks |= set(allocator._pools[small].blocks.values()) | set(allocator._unmapped[small].values())
    chained, mapped = set(), 0
    for head in (b for b in blocks if b.prev is None):
        block, address = head, head.address
        while block is not None:
            assert block.address == address and (block.next is None or block.next.prev is block)
            assert block.stream == head.stream
            assert block.next is None or block.allocated or block.next.allocated or block.mapped != block.next.mapped
            chained.add(block)
            mapped += block.size if block.mapped else 0
            address, block = address + block.size, block.next
    assert chained == blocks and mapped == allocator.reserved
    assert allocator.allocated == sum(b.size for b in allocator._live.values())


# -- what NVML adds ------------------------------------------------------------------------------------------


def test_cublas_workspaces_and_nvml():
    assert cublas_workspace_bytes(9, 0) == 32 * MiB  # Hopper: :4096:8
    assert cublas_workspace_bytes(8, 0) == 8 * MiB + 128 * KiB  # :4096:2:16:8
    r = replay(workspace_trace(cublas_workspace_bytes(9, 0)) + events(("+", 100)))
    assert (r.peak_allocated_bytes, r.peak_reserved_bytes) == (64 * MiB + 512, 66 * MiB)
    r = replay(workspace_trace(cublas_workspace_bytes(8, 6), threads=1))  # 8.125 MiB: from a 20 MiB segment
    assert r.peak_reserved_bytes == 20 * MiB
    assert nvml_bytes(20 * MiB) == 20 * MiB + CUDA_CONTEXT_BYTES
    assert nvml_bytes(20 * MiB, context_bytes=300 * MiB, other_bytes=MiB) == 321 * MiB


def test_the_model_imports_without_torch():
    _python("from autotune.meters.caching_allocator import replay\nassert replay([(1, 1)]).segments == 1\n",
            without_torch=True)


# -- the tensor meter's trace --------------------------------------------------------------------------------


def test_the_tensor_meter_keeps_no_trace_unless_asked():
    meter = TensorMeter()
    with meter.measure() as h:
        torch.zeros(10)
    assert h.trace is None and meter.last_trace is None


def test_the_trace_follows_allocations_frees_resizes_moves_and_passing_peaks():
    meter = TensorMeter(trace=True)
    with meter.measure() as h:
        a = torch.empty(1000, dtype=torch.uint8)
        view = a[10:]  # a view: no allocation
        a.untyped_storage().resize_(2000)  # resized in place: freed at 1000, allocated at 2000
        b = torch.empty(300, dtype=torch.uint8)
        leave_device([b])  # moved off the device: freed
        passing_peak(64)  # allocated and freed at once
        del a, view
        c = torch.empty(10, dtype=torch.uint8)
    assert h.trace == ((1000, 1), (-1000, 1), (2000, 2), (300, 3), (-300, 3), (64, 4), (-64, 4), (-2000, 2), (10, 5))
    assert meter.last_trace == h.trace  # c outlived the region: no free event
    del b, c


def test_the_trace_says_which_stream_made_each_storage_and_the_replay_caches_for_it():
    """torch.cpu.stream, as code written for any device selects a stream (FSDP2 gathers and reduces on its own): a
    storage made on another stream than the region's first carries that stream's number, counted from 1."""
    meter, side = TensorMeter(trace=True), torch.cpu.Stream()
    with meter.measure() as h:
        a = torch.empty(3 * MiB, dtype=torch.uint8)
        with torch.cpu.stream(side):
            b = torch.empty(3 * MiB, dtype=torch.uint8)
        del a, b
        c = torch.empty(3 * MiB, dtype=torch.uint8)
    assert h.trace == ((3 * MiB, 1), (3 * MiB, 2, 1), (-3 * MiB, 1), (-3 * MiB, 2), (3 * MiB, 3))
    assert replay(h.trace).peak_reserved_bytes == 40 * MiB  # one 20 MiB segment a stream; c reuses stream 0's
    assert replay([event[:2] for event in h.trace]).peak_reserved_bytes == 20 * MiB  # one stream: one segment
    del c


def test_a_refused_allocation_leaves_no_trace():
    meter = TensorMeter(budget_bytes=1500, trace=True)
    with meter.measure() as h:
        a = torch.empty(1000, dtype=torch.uint8)
        with pytest.raises(BudgetExceededError):
            torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(400, dtype=torch.uint8)
    assert h.trace == ((1000, 1), (400, 3))
    del a, b


def test_a_training_step_under_fake_tensors_replays_to_whole_2_mib_reserved():
    workload = Workload.from_specs("autotune.examples:TinyGPT")  # at batch 16, storages of 512 B to 12.5 MiB
    with FakeTensorMode(allow_non_fake_inputs=True):
        meter = TensorMeter(trace=True)
        with meter.measure() as h:
            model = workload.build_model(seed=0)
            optimizer = torch.optim.AdamW(model.parameters())
            workload.loss(model, workload.make_batch(model, 16)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del model, optimizer
    trace = h.trace
    live = peak = rounded = rounded_peak = 0
    for nbytes, _ in trace:
        live += nbytes
        rounded += round_size(abs(nbytes)) if nbytes > 0 else -round_size(-nbytes) if nbytes < 0 else 0
        peak, rounded_peak = max(peak, live), max(rounded_peak, rounded)
    assert peak == h.reading.peak_bytes and live == 0  # the trace is the meter's count, event by event
    assert any(n > 10 * MiB for n, _ in trace) and any(0 < n <= MiB for n, _ in trace)
    for settings in (AllocatorSettings(), EXPANDABLE):
        r = replay(trace, settings=settings)
        assert r.peak_requested_bytes == h.reading.peak_bytes
        assert r.peak_allocated_bytes == rounded_peak  # each storage rounded to 512 bytes, no block left unsplit
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes and r.peak_reserved_bytes % (2 * MiB) == 0
        assert r.allocated_bytes == 0 and r.reserved_bytes == r.peak_reserved_bytes  # nothing given back unasked


# -- benchmarks/gpu_check.py's CPU side ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" /
                                                  "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_gpu_checks_patterns_are_the_rules_tested_here(gpu_check):
    replays = {name: replay(trace, settings=AllocatorSettings(expandable_segments=expandable), capacity_bytes=capacity)
               for name, trace, capacity, expandable in gpu_check.allocator_patterns()}
    assert replays["25 MiB: 26 MiB"].peak_reserved_bytes == 26 * MiB
    assert replays["cache given back, retried"].retries == 1 and not replays["cache given back, retried"].oom
    assert replays["a split segment kept"].retries == 1 and replays["out of memory"].oom
    assert replays["expandable: freed pages merge"].peak_reserved_bytes == 40 * MiB
    assert replays["expandable: unmapped, retried"].reserved_bytes == 60 * MiB


def test_gpu_checks_traced_prediction_counts_what_predict_trial_counts(gpu_check, tiny_gpt_kwargs):
    from autotune.execution.predict import predict_trial
    from autotune.records import Config, TrialSettings

    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=tiny_gpt_kwargs)
    config, settings = Config("fp32", 0, 4), TrialSettings()
    rules = CudaRules(torch.device("cpu"))  # the CPU's fake tensors with CUDA's rules, as a machine without a GPU
    trace = gpu_check.predict_traced(workload, config, torch.device("cpu"), settings, 1, rules)
    live = peak = 0
    for nbytes, _ in trace:
        live += nbytes
        peak = max(peak, live)
    assert peak == predict_trial(workload, config, device="cpu", settings=settings).peak_bytes > 0
    bf16 = Config("bf16", 0, 4)  # under CUDA's autocast lists: the same trace as the dry run's, replayed alike
    trace = gpu_check.predict_traced(workload, bf16, torch.device("cpu"), settings, 1, rules)
    predicted = predict_trial(workload, bf16, settings=settings, cuda=rules)
    assert rules.replayed(trace, None).peak_reserved_bytes == predicted.peak_reserved_bytes > 0
    assert rules.replayed(trace, None).peak_allocated_bytes == predicted.peak_allocated_bytes

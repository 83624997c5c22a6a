"""The caching allocator's model held against records: GPUs' memory snapshots found in public repositories, and the
model's own records cut anywhere, replayed event by event from the state their recording began in."""

import gzip
import json
import pathlib
import random

import pytest

from autotune.meters.allocator_record import RecordSettings, _Replayer, record_settings, replay_record
from autotune.meters.caching_allocator import AllocatorOutOfMemory, AllocatorSettings, CachingAllocator, round_size
from autotune.meters.memory_snapshot import FORMAT, load_record
from autotune.meters.record_start import rebuild_start
from tests.test_house import _python
from tests.paths import DATA

MiB = 1 << 20
TRACES = sorted((DATA / "allocator_traces").glob("*.json.gz"))


# -- GPUs' records -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.split(".")[0])
def test_a_gpus_record_replays_as_the_gpu_ran_it(path):
    record = load_record(str(path))
    assert set(record["source"]) == {"repository", "commit", "path"}  # where it was found
    result = replay_record(record)
    assert result["events"] > 0
    if result["streams"] == 1:  # reserved bytes equal after every event, every segment as recorded
        assert result["first_difference"] is None, result["first_difference"]
        assert result["replayed"] == result["recorded"]
    else:  # several streams: the peak within 1%
        recorded, replayed = result["recorded"]["peak_reserved_bytes"], result["replayed"]["peak_reserved_bytes"]
        assert abs(replayed - recorded) <= recorded / 100
    assert all(d["allocs_at_recorded_address"] == d["allocs"] for d in result["devices"])  # where the GPU put each


def test_the_gpus_records_hold_what_a_replay_must_get_right():
    results = [replay_record(load_record(str(p))) for p in TRACES]
    devices = [d for r in results for d in r["devices"]]
    assert any(r["streams"] > 1 for r in results) and any(len(r["devices"]) > 1 for r in results)
    assert any(r["settings"]["expandable_segments"] for r in results)
    assert any(r["first_difference"] is None and not r["settings"]["expandable_segments"] for r in results)
    assert any(d["start"]["blocks_held"] for d in devices)  # recordings that began mid-run
    assert any(d["empty_cache_calls"] for d in devices) and any(d["failed_allocations"] for d in devices)
    assert sum(r["events"] for r in results) > 50_000


def test_the_committed_records_are_numbers_only():
    for path in TRACES:
        record = json.loads(gzip.decompress(path.read_bytes()))
        assert set(record) == {"format", "source", "allocator_settings", "segments", "device_traces"}
        assert record["format"] == FORMAT
        for trace in record["device_traces"]:
            assert set(trace) == {"action", "addr", "size", "stream"}
            assert all(isinstance(v, int) for key in ("addr", "size", "stream") for v in trace[key])
        for segment in record["segments"]:
            assert set(segment) == {"device", "address", "total_size", "stream", "segment_type", "is_expandable",
                                    "blocks"}
            assert all(len(b) == 3 and isinstance(b[0], int) and isinstance(b[1], int) for b in segment["blocks"])


# -- the model's own records ---------------------------------------------------------------------------------


class _Recorder(CachingAllocator):
    """The model, writing down the trace torch's allocator would record of it; :meth:`record` is its snapshot."""

    def __init__(self, settings, capacity_bytes):
        super().__init__(settings, capacity_bytes=capacity_bytes)
        self.trace, self.states = [], {}

    def _traced(self, action, address, nbytes, stream):
        self.trace.append((action, address, nbytes, stream))

    def malloc(self, key, nbytes, *, stream=0):
        try:
            super().malloc(key, nbytes, stream=stream)
        except AllocatorOutOfMemory:
            self.trace.append(("oom", 0, round_size(nbytes), stream))
            raise
        self.trace.append(("alloc", self._live[key].address, nbytes, stream))

    def free(self, key):
        block = self._live[key]
        address, requested, stream = block.address, block.requested, block.stream
        super().free(key)
        self.trace += [("free_requested", address, requested, stream), ("free_completed", address, requested, stream)]

    def runs(self):
        """Each segment's mapped runs of blocks (a cudaMalloc'd segment: one), as a snapshot lists them."""
        blocks = list(self._live.values()) + [b for small in (True, False) for b in
                                              list(self._pools[small].blocks.values()) + list(
                                                  self._unmapped[small].values())]
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.address):
            run, block = [], head
            while block is not None:
                run += [block] if block.mapped else []
                if run and (not block.mapped or block.next is None):
                    yield run
                    run = []
                block = block.next

    def state(self):
        """What a rebuilt start should say: the segments (mapped runs) and the blocks handed out."""
        segments = sorted((r[0].address, sum(b.size for b in r), r[0].stream, r[0].small) for r in self.runs())
        return segments, {b.address: (b.size, b.requested) for b in self._live.values()}

    def record(self, cut):
        """The snapshot at the end, its trace from event ``cut`` on, as a record."""
        segments = [{"device": 0, "address": r[0].address, "total_size": sum(b.size for b in r),
                     "stream": r[0].stream, "segment_type": "small" if r[0].small else "large",
                     "is_expandable": r[0].segment is not None,
                     "blocks": [[b.size, b.requested, "active_allocated" if b.allocated else "inactive"] for b in r]}
                    for r in self.runs()]
        trace = self.trace[cut:]
        return {"format": FORMAT, "source": None,
                "allocator_settings": {"expandable_segments": self.settings.expandable_segments},
                "segments": segments, "device_traces": [{key: [e[i] for e in trace] for i, key in
                                                         enumerate(("action", "addr", "size", "stream"))}]}


def _recorded(seed, *, expandable, split_always):
    """The model run on a random workload: several streams, frees, empty_cache() and, under a capacity, failed
    allocations and ooms. ``split_always``: large requests of whole 2 MiB, so no block is ever handed out whole."""
    rnd = random.Random(seed)
    recorder = _Recorder(AllocatorSettings(expandable_segments=expandable), rnd.choice([None, 300 * MiB, 600 * MiB]))
    live, streams = [], rnd.choice([[0], [0, 7], [0, 7, 9]])
    for key in range(1, 400):
        recorder.states[len(recorder.trace)] = recorder.state()
        if live and rnd.random() < 0.45:
            recorder.free(live.pop(rnd.randrange(len(live))))
        elif rnd.random() < 0.04:
            recorder.release_cached()
        else:
            size = rnd.choice([rnd.randint(1, MiB), rnd.randint(MiB, 12 * MiB), rnd.randint(10 * MiB, 90 * MiB)])
            size = -(-size // (2 * MiB)) * 2 * MiB if split_always and size > MiB else size
            try:
                recorder.malloc(key, size, stream=rnd.choice(streams))
                live.append(key)
            except AllocatorOutOfMemory:
                pass
    return recorder, rnd


def _agrees(result):
    return result["first_difference"] is None and result["recorded"] == result["replayed"] and all(
        d["allocs_at_recorded_address"] == d["allocs"] for d in result["devices"])


@pytest.mark.parametrize("expandable", [False, True])
def test_the_models_own_record_replays_from_an_empty_start(expandable):
    for seed in range(6):
        recorder, _ = _recorded(seed, expandable=expandable, split_always=False)
        result = replay_record(recorder.record(0))
        assert _agrees(result), (seed, result["first_difference"])
        assert result["devices"][0]["failed_allocations"] or result["devices"][0]["empty_cache_calls"]


@pytest.mark.parametrize("expandable", [False, True])
def test_a_record_cut_anywhere_starts_where_the_allocator_was_and_replays(expandable):
    """A ring buffer's cut: the start rebuilt from the snapshot and the trace after the cut is the allocator's state
    there, and the replay from it agrees with the record (every large block split: no size is left in doubt)."""
    for seed in range(4):
        recorder, rnd = _recorded(seed, expandable=expandable, split_always=True)
        for cut in rnd.sample(range(len(recorder.trace)), 5):
            assert _agrees(replay_record(recorder.record(cut))), (seed, cut)
        for cut in rnd.sample(sorted(recorder.states), 5):
            start = rebuild_start(recorder.record(cut), 0)
            segments, held = recorder.states[cut]
            assert sorted(start.segments + start.mapped) == segments and start.blocks == held, (seed, cut)


def _hand_made(blocks, events, segment=(1 << 32, 20 * MiB)):
    """A record of one large cudaMalloc'd segment: its final ``blocks`` and the trace ``events``."""
    address, size = segment
    return {"format": FORMAT, "source": None, "allocator_settings": None,
            "segments": [{"device": 0, "address": address, "total_size": size, "stream": 0, "segment_type": "large",
                          "is_expandable": False, "blocks": blocks}],
            "device_traces": [{key: [e[i] for e in events] for i, key in
                               enumerate(("action", "addr", "size", "stream"))}]}


def test_a_block_handed_out_whole_is_seen_where_the_next_allocation_lands():
    # before the recording a 4 MiB request took a free 4.5 MiB block whole (0.5 MiB is not worth a block of the
    # large pool); the 8 MiB allocated next lands right after it, not at 4 MiB
    a = 1 << 32
    record = _hand_made([[20 * MiB, 0, "inactive"]], [
        ("alloc", a + 9 * MiB // 2, 8 * MiB, 0), ("free_requested", a, 4 * MiB, 0), ("free_completed", a, 4 * MiB, 0),
        ("free_requested", a + 9 * MiB // 2, 8 * MiB, 0), ("free_completed", a + 9 * MiB // 2, 8 * MiB, 0)])
    assert rebuild_start(record, 0).blocks == {a: (9 * MiB // 2, 4 * MiB)}
    result = replay_record(record)
    assert _agrees(result) and result["devices"][0]["allocs"] == 1


def test_a_gap_of_1_mib_or_less_after_a_block_is_the_blocks_own():
    a = 1 << 32  # 19.5 MiB handed out from a 20 MiB segment: the last 0.5 MiB with it
    record = _hand_made([[20 * MiB, 0, "inactive"]], [("free_requested", a, 39 * MiB // 2, 0),
                                                      ("free_completed", a, 39 * MiB // 2, 0)])
    start = rebuild_start(record, 0)
    assert start.blocks == {a: (39 * MiB // 2, 39 * MiB // 2)} and start.reserved_bytes == 20 * MiB
    model = _Replayer(AllocatorSettings(), start)
    assert (model.allocated, model._live[a].size, len(model._pools[False].keys)) == (20 * MiB, 20 * MiB, 0)


def test_a_record_no_allocator_could_have_made_stops_the_replay_where_it_stops_making_sense():
    a = 1 << 32  # a block held at the end, and one freed during the trace that would lie inside it
    record = _hand_made([[4 * MiB, 4 * MiB, "active_allocated"], [16 * MiB, 0, "inactive"]], [
        ("free_requested", a + MiB, 4 * MiB, 0), ("free_completed", a + MiB, 4 * MiB, 0),
        ("segment_alloc", a + 64 * MiB, 20 * MiB, 0), ("alloc", a + 64 * MiB, 3 * MiB, 0)])
    result = replay_record(record)
    assert result["first_difference"] == {"device": 0, "event": 0, "action": "free_requested",
                                          "stopped": f"blocks at the start overlap at {a + MiB:#x}"}
    assert result["recorded"]["segment_allocs"] == 1 and result["replayed"]["segment_allocs"] == 0


def test_the_allocator_settings_of_a_record():
    record = {"segments": [], "device_traces": [], "allocator_settings": {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,max_non_split_rounding_mb:64", "max_split_size": 128 * MiB,
        "expandable_segments": False, "garbage_collection_threshold": 0.0,
        "roundup_power2_divisions": {"1": 0, "2": 4}}}
    made_under = record_settings(record)
    settings, unmodelled = made_under.settings, made_under.unmodelled
    assert (settings.max_split_bytes, settings.max_non_split_rounding_bytes, settings.expandable_segments) == (
        128 * MiB, 64 * MiB, False)
    assert unmodelled == ["roundup_power2_divisions"]
    record["allocator_settings"] = None  # an old torch's snapshot: torch's defaults, expandable where it mapped
    record["device_traces"] = [{"action": ["segment_map"], "addr": [0], "size": [2 * MiB], "stream": [0]}]
    assert record_settings(record) == RecordSettings(AllocatorSettings(expandable_segments=True), [])


def test_the_replay_imports_without_torch():
    _python(f"from autotune.meters.allocator_record import replay_record\n"
            f"from autotune.meters.memory_snapshot import load_record\n"
            f"assert replay_record(load_record({str(TRACES[0])!r}))['first_difference'] is None\n", without_torch=True)

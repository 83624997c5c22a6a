"""Memory snapshots read safely, as numbers: a pickle that names a class is refused unread, and what is not a snapshot
says so in one line."""

import collections
import gzip
import json
import os
import pathlib
import pickle

import pytest

from autotune.errors import UsageError
from autotune.meters.memory_snapshot import FORMAT, load_record, numbers_only
from tests.paths import DATA

TRACES = sorted((DATA / "allocator_traces").glob("*.json.gz"))


def as_snapshot(record: dict) -> dict:
    """A record as ``torch.cuda.memory._snapshot()`` shapes it, stack frames and all."""
    frames = [{"filename": "/home/someone/train.py", "line": 12, "name": "forward"}]
    segments = []
    for s in record["segments"]:
        address, blocks = s["address"], []
        for size, requested, state in s["blocks"]:
            blocks.append({"address": address, "size": size, "requested_size": requested, "state": state,
                           "frames": frames})
            address += size
        segments.append({**{k: v for k, v in s.items() if k != "blocks"}, "blocks": blocks, "frames": frames,
                         "segment_pool_id": (0, 0), "allocated_size": 0, "active_size": 0, "requested_size": 0})
    traces = [[{"action": a, "addr": d, "size": z, "stream": st, "time_us": 1, "frames": frames, "compile_context": ""}
               for a, d, z, st in zip(t["action"], t["addr"], t["size"], t["stream"])] for t in record["device_traces"]]
    return {"segments": segments, "device_traces": traces, "allocator_settings": record["allocator_settings"],
            "external_annotations": [{"stage": "START", "name": "step", "device": 0, "time_us": 1}]}


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_a_snapshot_pickle_reads_as_its_numbers(tmp_path, protocol):
    record = load_record(str(TRACES[0]))
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(as_snapshot(record), protocol=protocol))
    assert load_record(str(path)) == {**record, "source": None}
    assert "frames" not in json.dumps(load_record(str(path)))


def test_a_record_reads_back_plain_or_gzipped(tmp_path):
    record = numbers_only(as_snapshot(load_record(str(TRACES[0]))), source={"repository": "a/b"})
    (tmp_path / "r.json").write_text(json.dumps(record))
    (tmp_path / "r.json.gz").write_bytes(gzip.compress(json.dumps(record).encode()))
    assert load_record(str(tmp_path / "r.json")) == load_record(str(tmp_path / "r.json.gz")) == record


class Harmful:
    """Unpickling it would make a directory: what any class named in a pickle could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_pickle_that_names_a_class_is_refused_unread(tmp_path):
    made = tmp_path / "made-by-the-pickle"
    for i, payload in enumerate([{"segments": [], "device_traces": [], "x": Harmful(str(made))},
                                 collections.OrderedDict(segments=[], device_traces=[])]):
        path = tmp_path / f"{i}.pickle"
        path.write_bytes(pickle.dumps(payload))
        with pytest.raises(UsageError, match="names .*a memory snapshot names no class") as caught:
            load_record(str(path))
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    assert not made.exists()


@pytest.mark.parametrize("content, says", [
    (b"", "not a pickle"),
    (b"segments, device_traces\n1, 2\n", "not a pickle"),
    (pickle.dumps([1, 2, 3]), "this is a list"),
    (pickle.dumps({"weights": [1.0]}), "a dict without segments"),
    (pickle.dumps({"segments": [{"address": 0}], "device_traces": []}), "without its numbers"),
    (pickle.dumps({"segments": [{"device": 0, "address": 0, "total_size": 4096, "stream": 0, "segment_type": "small",
                                 "blocks": [{"size": 512, "state": "inactive"}]}], "device_traces": []}),
     "do not add up"),
    (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc"}]]}), "without its numbers"),
    (pickle.dumps({"segments": []})[:-3], "not a pickle"),
    (json.dumps({"format": "something else"}).encode(), "not a record"),
    (b"{not json", "does not parse"),
    (b"\x1f\x8b\x08\x00garbage", "broken gzip"),
])
def test_what_is_not_a_snapshot_says_so_in_one_line(tmp_path, content, says):
    path = tmp_path / "file"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=says) as caught:
        load_record(str(path))
    assert "\n" not in str(caught.value) and "not a memory snapshot" in str(caught.value)


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(UsageError, match="cannot be read"):
        load_record(str(tmp_path / "none.pickle"))


def test_an_old_torchs_snapshot_without_settings_streams_or_segment_types():
    snapshot = {"segments": [{"device": 0, "address": 1 << 30, "total_size": 2 << 20, "stream": None,
                              "blocks": [{"size": 2 << 20, "state": "inactive"}]}],
                "device_traces": [[{"action": "alloc", "addr": 1 << 30, "size": 100}]]}
    record = numbers_only(snapshot)
    assert record["format"] == FORMAT and record["allocator_settings"] is None
    assert record["segments"][0]["segment_type"] == "small" and record["segments"][0]["blocks"] == [
        [2 << 20, 2 << 20, "inactive"]]
    assert record["device_traces"] == [{"action": ["alloc"], "addr": [1 << 30], "size": [100], "stream": [0]}]

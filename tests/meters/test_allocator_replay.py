"""benchmarks/allocator_replay.py: GPU records replayed through the allocator's model, its JSON and table; bad input
gets one line and exit 2, and nothing written."""

import gzip
import hashlib
import json
import pathlib
import pickle
import subprocess
import sys

from tests.meters.test_memory_snapshot import TRACES, Harmful, as_snapshot
from tests.paths import ROOT

SCRIPT = ROOT / "benchmarks" / "allocator_replay.py"


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_records_replay_into_a_json_list_and_a_table(tmp_path):
    files = [TRACES[0], next(p for p in TRACES if "streams" in p.name)]
    out = _run(*files, "--json", tmp_path / "out.json", "--md", tmp_path / "out.md")
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["file"] for r in results] == [str(f) for f in files]
    for r in results:
        assert {"file", "recorded", "replayed", "first_difference"} <= set(r)
        assert set(r["recorded"]) == set(r["replayed"]) == {"segment_allocs", "segment_frees", "peak_reserved_bytes"}
        assert r["first_difference"] is None and r["recorded"] == r["replayed"]
    assert results[1]["streams"] > 1
    table = (tmp_path / "out.md").read_text()
    assert "**2 of 2 records replay with the same segments" in table
    assert all(f"{r['source']['repository']} `{r['source']['path']}`" in table for r in results)


def test_a_snapshot_is_named_by_its_git_blob_in_the_sources(tmp_path):
    snapshot = tmp_path / "memory_snapshot.pickle"
    snapshot.write_bytes(pickle.dumps(as_snapshot(json.loads(gzip.decompress(TRACES[0].read_bytes())))))
    data = snapshot.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps([{"repository": "someone/course", "commit": "c0ffee", "path": "a/b.pickle",
                                    "blob": blob}]))
    out = _run(snapshot, "--json", tmp_path / "out.json", "--sources", sources, "--numbers-only", tmp_path / "n")
    assert out.returncode == 0, out.stderr
    [result] = json.loads((tmp_path / "out.json").read_text())
    assert result["source"] == {"repository": "someone/course", "commit": "c0ffee", "path": "a/b.pickle"}
    written = (tmp_path / "n" / "memory_snapshot.json.gz").read_bytes()
    assert json.loads(gzip.decompress(written))["source"] == result["source"]
    assert "frames" not in gzip.decompress(written).decode()
    assert _run(snapshot, "--sources", sources, "--numbers-only", tmp_path / "n").returncode == 0
    assert (tmp_path / "n" / "memory_snapshot.json.gz").read_bytes() == written  # the same bytes each time


def test_bad_input_gets_one_line_exit_2_and_nothing_written(tmp_path):
    made = tmp_path / "made-by-the-pickle"
    bad = {"text.pickle": b"not a snapshot\n", "class.pickle": pickle.dumps(Harmful(str(made))),
           "list.pickle": pickle.dumps([1, 2]), "empty.pickle": b""}
    out_json, out_md = tmp_path / "out.json", tmp_path / "out.md"
    out_json.write_text("[\"kept\"]\n")
    for name, content in bad.items():
        (tmp_path / name).write_bytes(content)
        out = _run(TRACES[0], tmp_path / name, "--json", out_json, "--md", out_md)
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert len(out.stderr.splitlines()) == 1 and name in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert out_json.read_text() == "[\"kept\"]\n" and not out_md.exists()  # the earlier results are not lost
    assert not made.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted([*bad, "out.json"])
    out = _run(tmp_path / "missing.pickle", "--json", out_json)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "cannot be read" in out.stderr

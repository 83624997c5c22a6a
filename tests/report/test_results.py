"""The reports committed in results/ are of the current schema, with every field a fresh run writes.

A report written by an older autotune (a trial field it did not record, a section it did not have) fails here:
regenerate it with the command that made it (benchmarks/regenerate_examples.sh, benchmarks/*.py) and re-sync the
docs' copies (python benchmarks/sync_docs.py).
"""

import dataclasses
import json
from pathlib import Path

import pytest

from autotune.records import Config, Measurement
from autotune.report import SCHEMA_VERSION, Report
from tests.paths import ROOT

RESULTS = ROOT / "results"

# what every search writes in the report's "search" (tuner.py); a dry run adds its own keys to these
SEARCH_KEYS = {"strategy", "n_trials_limit", "n_trials", "n_run", "n_reused", "wall_s", "study", "storage", "space",
               "warmup_steps", "measure_steps", "settle_steps", "predictions", "trial_timeout_s", "memory_meter",
               "isolation", "partial", "figures", "timed_after_memory_trial", "setup_s", "steps_s"}


def _reports() -> list[Path]:
    """Every JSON file in results/ that is a report (has a schema_version), not a benchmark's summary."""
    found = []
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "schema_version" in data:
            found.append(path)
    return found


def _fresh() -> dict:
    """What Report.to_dict writes today, for a one-trial report: the keys every report has."""
    trial = Measurement(Config("fp32", "0", 1), "ok", peak_bytes=1, step_s=1.0, samples_per_s=1.0)
    space = {"precisions": ["fp32"], "segments": ["0"], "batch_sizes": [1]}
    return Report(environment={}, workload={}, budget_bytes=None, headroom=0.1, search={"space": space},
                  trials=(trial,)).to_dict()


REPORTS = _reports()


def test_results_holds_reports():
    names = {p.name for p in REPORTS}
    assert {"example-gpt2-cpu.json", "grid-TinyGPT-cpu.json", "selective-front-TinyGPT-cpu.json"} <= names


def test_every_measurement_field_is_in_the_fresh_trial_dict():
    """The check below is the dataclass's fields; a fresh trial's dict has them all (config as three keys)."""
    trial = _fresh()["trials"][0]
    for field in dataclasses.fields(Measurement):
        if field.name == "config":
            assert {"precision", "segments", "batch_size"} <= set(trial)
        else:
            assert field.name in trial


@pytest.mark.parametrize("path", REPORTS, ids=[p.name for p in REPORTS])
def test_a_committed_report_is_of_the_current_schema_with_every_field(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["schema_version"] == SCHEMA_VERSION, f"{path.name}: schema {data['schema_version']}, regenerate it"
    fresh = _fresh()
    assert sorted(set(fresh) - set(data)) == [], f"{path.name}: report sections missing"
    assert sorted(SEARCH_KEYS - set(data["search"])) == [], f"{path.name}: search fields missing"
    fields = {f.name for f in dataclasses.fields(Measurement)} - {"config"} | {"precision", "segments", "batch_size"}
    for kind in ("trials", "predictions", "pareto"):
        for i, trial in enumerate(data[kind]):
            assert sorted(fields - set(trial)) == [], f"{path.name}: {kind}[{i}] lacks these Measurement fields"
    if data["recommendation"] is not None:
        assert sorted(fields - set(data["recommendation"])) == [], f"{path.name}: the recommendation lacks fields"
    Report.from_dict(data)  # and it reads back

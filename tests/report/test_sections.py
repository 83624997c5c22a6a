"""The report's search section as a record: fields named in one place, the JSON it was, read back whole."""

import dataclasses
import json

import pytest

from autotune.report import Report, SearchSection
from tests.report.test_results import REPORTS, SEARCH_KEYS


def test_a_stage_sets_a_named_field_and_a_misspelt_one_fails_where_it_is_written():
    section = SearchSection(strategy="grid", n_trials=3)
    assert section.but(partial=True).partial and not section.partial  # frozen: a copy
    with pytest.raises(TypeError):
        section.but(exact_limits={})  # the field is exact_limit


def test_a_stage_that_did_not_run_writes_nothing_and_one_that_did_writes_its_field():
    section = SearchSection(strategy="grid", n_trials=3, storage=None)
    data = section.to_dict()
    assert not {"dry_run", "time_model", "cuda", "exact_limit", "static_compile", "eval_limits"} & set(data)
    assert not {"host_budget_bytes", "host_budget_source"} & set(data)  # no offloading plan searched
    assert data["storage"] is None and "storage" in data  # a field of the search's own: written, even when None
    later = section.but(exact_limit={"confirmed": True}, host_budget_source="--host-budget", host_budget_bytes=None)
    assert later.to_dict()["exact_limit"] == {"confirmed": True}
    assert later.to_dict()["host_budget_bytes"] is None and later.to_dict()["host_budget_source"] == "--host-budget"


def test_it_reads_as_the_mapping_it_was():
    section = SearchSection(strategy="auto", storage="sqlite:///x.db", more={"workers_started": 2})
    assert section["storage"] == "sqlite:///x.db" and section.get("workers_started") == 2
    assert section.get("exact_limit") is None and "exact_limit" not in section and "strategy" in section
    assert {**section} == section.to_dict() and len(section) == len(section.to_dict())
    with pytest.raises(KeyError):
        section["static_compile"]


def test_the_fields_every_search_writes_are_the_records():
    written = set(SearchSection(strategy="grid").to_dict())
    assert SEARCH_KEYS <= written, sorted(SEARCH_KEYS - written)


@pytest.mark.parametrize("path", REPORTS, ids=[p.name for p in REPORTS])
def test_a_committed_reports_search_reads_back_to_the_same_object(path):
    """Every key of a committed report's search, the venue's and an older version's included, survives a read and a
    write (what this version does not name is kept in ``more``); a field the report's version did not write reads as
    None."""
    data = json.loads(path.read_text(encoding="utf-8"))["search"]
    for written in (SearchSection.from_dict(data).to_dict(),
                    Report.from_dict(json.loads(path.read_text(encoding="utf-8"))).to_dict()["search"]):
        assert {k: v for k, v in written.items() if k in data} == data
        assert all(v is None for k, v in written.items() if k not in data)


def test_a_report_made_with_a_mapping_holds_a_record():
    report = Report(environment={}, workload={}, budget_bytes=None, headroom=0.1,
                    search={"space": {"precisions": ["fp32"]}, "storage": "x"}, trials=())
    assert isinstance(report.search, SearchSection) and report.search.storage == "x"
    assert dataclasses.replace(report, search=report.search.but(partial=True)).search["partial"] is True



def test_a_dry_runs_recommendation_does_not_tell_apart_what_its_time_model_cannot():
    """Predicted throughputs within the time model's checked error (``search.time_model.checked``) tie: the largest
    batch among them is recommended; where the error was not checked (a card's), 5%."""
    from autotune.records import PREDICTED, Config, Measurement

    def trial(batch, per_s):
        return Measurement(Config("fp32", "0", batch), "ok", peak_bytes=batch, samples_per_s=per_s,
                           step_s=batch / per_s, time_source=PREDICTED)

    trials = (trial(8, 100.0), trial(32, 90.0))  # the larger batch predicted 10% slower
    unchecked = Report(environment={}, workload={}, budget_bytes=None, headroom=0.1,
                       search=SearchSection(strategy="dry-run", dry_run=True, time_model={"name": "rtx4090"}),
                       trials=trials)
    assert unchecked.predicted_tie == 0.05 and unchecked.recommendation.batch_size == 8
    checked = dataclasses.replace(unchecked, search=unchecked.search.but(
        time_model={"name": "cpu", "checked": {"median_abs_error": 0.134}}))
    assert checked.predicted_tie == 0.134 and checked.recommendation.batch_size == 32

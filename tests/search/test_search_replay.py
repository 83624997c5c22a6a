"""``auto`` replayed on the committed grid reports: every limit the grid's, within 1.3x the oracle's trials.

The grid reports (``results/grid-*-cpu.json``, written by ``benchmarks/search_efficiency.py``) hold a
trial of every configuration of the bundled models' spaces. Peaks repeat exactly from run to run,
so replaying ``auto`` against them (:func:`search_efficiency.replay`) follows the bracket a real run
takes; the climb follows the grid's single timing of each point. The benchmark's full run measures
the same thing side by side with real trials; this catches a strategy change that costs trials or
loses a limit, in a second.
"""

import os
import sys

import pytest

import autotune
from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import search_efficiency  # noqa: E402


@pytest.mark.parametrize("model", ["TinyGPT", "ResNetish"])
def test_auto_replayed_on_the_grid_finds_every_limit_within_the_trial_target(model):
    report = autotune.load(os.path.join(ROOT, "results", f"grid-{model}-cpu.json"))
    summary = search_efficiency.replay_summary(report)
    assert summary["limits_equal_grid"]
    assert summary["trials"] <= 1.3 * summary["oracle"]  # issue 26's target
    # The recommendation is not compared: the replayed climb follows the grid's one timing of each point, whose noise
    # on this CPU reorders near ties (docs/benchmarks.md); the full benchmark times them again in fresh trials.
    assert summary["recommendation"] is not None


def test_the_replay_answers_each_proposal_with_the_grids_trial():
    report = autotune.load(os.path.join(ROOT, "results", "grid-ResNetish-cpu.json"))
    grid = {m.config: m for m in report.trials}
    trials = search_efficiency.replay(report)
    for m in trials:
        assert m.peak_bytes == grid[m.config].peak_bytes and m.status == grid[m.config].status
        assert m.samples_per_s in (None, grid[m.config].samples_per_s)  # a memory trial has no time
    assert any(not m.timed for m in trials) and any(m.timed for m in trials)


@pytest.mark.parametrize("model", ["TinyGPT", "ResNetish"])
def test_auto_seeded_by_predictions_needs_no_more_trials_than_the_oracle(model):
    """Issue 35's goal: started from the predicted space (on the tensor meter, the grid's own peaks: a prediction equals
    the measurement to the byte), auto finds every limit in at most the oracle's trials: each largest fit measured,
    each failing side implied by a confirmed prediction."""
    report = autotune.load(os.path.join(ROOT, "results", f"grid-{model}-cpu.json"))
    plain, seeded = search_efficiency.replay_summary(report), search_efficiency.replay_summary(report, predicted=True)
    assert seeded["limits_equal_grid"]
    assert seeded["trials"] <= seeded["oracle"] and seeded["trials"] < plain["trials"]

import dataclasses
import shutil

import optuna
import pytest

from autotune.errors import UsageError
from autotune.execution.venue import Here
from autotune.meters import TensorMeter
from autotune.analysis.pareto import pareto_front, recommend
from autotune.records import Config, TrialSettings, timing_fields
from autotune.search.loop import run_search
from autotune.search.space import SearchSpace
from autotune.search.strategies import GridStrategy, make_strategy
from autotune.training.workload import Workload
from autotune.vocabulary import Plan, Status

from tests.conftest import TINY_GPT

QUICK = TrialSettings(warmup_steps=2, measure_steps=2)
SPACE = SearchSpace(("fp32", "bf16"), (0, 2), (1, 4, 64))
BUDGET = 3 * 2**20  # batch 64 of the tiny GPT does not fit


@pytest.fixture
def gpt(tiny_gpt_kwargs):
    return Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=tiny_gpt_kwargs)


def search(gpt, storage, *, budget=BUDGET, study="s", key="k", space=SPACE, seen=None, venue=None):
    return run_search(
        gpt, space, GridStrategy(), venue=venue or Here("cpu", TensorMeter(budget_bytes=budget)), enforced_bytes=budget,
        settings=QUICK, study_name=study, storage=storage, workload_key=key,
        on_trial=(lambda m, reused: seen.append((m.config, reused))) if seen is not None else None,
    )


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The grid over SPACE, searched once for the module: its store's file and the result."""
    path = tmp_path_factory.mktemp("grid") / "trials.db"
    return path, search(Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=dict(TINY_GPT)), f"sqlite:///{path}")


@pytest.fixture
def searched(grid, tmp_path):
    """A copy of the grid's store, as a finished search left it, and the search's result."""
    path, result = grid
    shutil.copy(path, tmp_path / "searched.db")
    return f"sqlite:///{tmp_path / 'searched.db'}", result


def test_grid_measures_every_point_as_an_optuna_trial(searched):
    storage, result = searched
    assert [m.config for m in result.measurements] == SPACE.configs()
    assert result.n_run == len(SPACE) and result.n_reused == 0
    assert {m.status for m in result.measurements if m.batch_size == 64} == {"oom"}
    study = optuna.load_study(study_name="s", storage=storage)
    trials = study.get_trials()
    assert len(trials) == len(SPACE)
    for t in trials:
        status = t.user_attrs["status"]
        assert t.user_attrs["measurement"]["status"] == status
        assert t.state == {"ok": optuna.trial.TrialState.COMPLETE, "oom": optuna.trial.TrialState.PRUNED}[status]
        if status == "ok":
            assert t.values[0] == pytest.approx(t.user_attrs["measurement"]["samples_per_s"])
            assert t.values[1] == t.user_attrs["measurement"]["peak_bytes"]
        assert Config(t.params["precision"], t.params["segments"], t.params["batch_size"]) in SPACE.configs()


def test_running_again_reuses_finished_trials(gpt, searched):
    storage, first = searched
    seen = []
    again = search(gpt, storage, seen=seen)
    assert again.n_run == 0 and again.n_reused == len(SPACE)
    assert all(reused for _, reused in seen)
    assert [m.to_dict() for m in again.measurements] == [m.to_dict() for m in first.measurements]
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == len(SPACE)


def test_a_larger_budget_re_runs_only_the_ooms(gpt, searched):
    storage, _ = searched
    bigger = search(gpt, storage, budget=64 * 2**20)
    assert bigger.n_run == 4  # the four batch-64 trials
    assert {m.status for m in bigger.measurements} == {"ok"}


def test_a_study_of_another_workload_is_refused(gpt, storage):
    small = SearchSpace(("fp32",), (0,), (1,))
    search(gpt, storage, space=small)
    with pytest.raises(UsageError, match="different model"):
        search(gpt, storage, space=small, key="other")


def test_unknown_strategy_is_bad_input():
    with pytest.raises(UsageError, match="grid"):
        make_strategy("bayes")


def test_a_new_study_names_its_objectives_for_optunas_own_tools(tmp_path):
    from autotune.search.store import open_study

    open_study("named", f"sqlite:///{tmp_path}/n.db", workload_key="k")
    assert optuna.load_study(study_name="named", storage=f"sqlite:///{tmp_path}/n.db").metric_names == [
        "samples_per_s", "peak_bytes"]


class _SteadyClock(Here):
    """This process, with each timed trial's steps replaced by a fixed model of their time, ``(a + c b)(1 + k r)`` for
    batch ``b`` and recompute share ``r``, fitted to this machine unloaded (0 at 4 and 16, all at 64: 589, 1320 and
    1240 samples/s): the climb's choices then do not depend on the machine's load. Memory stays measured."""

    def run(self, workload, work):
        m = super().run(workload, work)
        if not m.timed or m.status != Status.OK:
            return m
        b = m.config.batch_size
        step = (0.005 + 0.00044 * b) * (1 + 0.55 * Plan(m.config.plan).recompute_share(4))
        return dataclasses.replace(m, **timing_fields(b, (step,) * len(m.step_times_s), None, True))


def test_auto_meters_the_bracket_and_times_only_the_envelope_completing_memory_trials(gpt, storage):
    # Tiny GPT, 10 MiB: plan 0 fits batch 16, not 64; plan 2 neither at 64; "all" fits 64. Step times from a fixed
    # model (_SteadyClock): with real times and three CPU hogs beside it, 1 run in 5 completed no memory trial (the
    # climb's choices follow the measured times), and the test failed.
    space = SearchSpace(("fp32",), ("0", "2", "all"), (1, 4, 16, 64), blocks=4)
    budget = 10 * 2**20
    venue = _SteadyClock("cpu", TensorMeter(budget_bytes=budget))
    result = run_search(gpt, space, make_strategy("auto", budgets=()), venue=venue,
                        enforced_bytes=budget, settings=QUICK, study_name="a",
                        storage=storage, workload_key="k")
    trials = optuna.load_study(study_name="a", storage=storage).get_trials()
    assert result.n_run == len(trials)
    measured = {m.config: m for m in result.measurements}
    # 0 at 64 is never run: plan 2, which recomputes more, ran out of memory there
    assert Config("fp32", "0", 64) not in measured and measured[Config("fp32", "2", 64)].status == "oom"
    memory = [t for t in trials if t.user_attrs.get("figures") == "memory" and t.user_attrs["status"] == "ok"]
    assert memory and all(t.state == optuna.trial.TrialState.PRUNED and t.values is None for t in memory)
    completions = [m for m in result.measurements if m.memory_from is not None]
    assert completions  # the climb reached a point first measured for its memory only
    for m in completions:
        source = trials[m.memory_from]
        assert source.user_attrs["figures"] == "memory" and Config.from_dict(source.params) == m.config
        assert m.peak_bytes == source.user_attrs["measurement"]["peak_bytes"] and m.samples_per_s > 0
    # what the front and the recommendation read has both figures; a configuration with memory only is not on it
    rec = recommend(result.measurements, budget)
    assert rec is not None and rec.figures == "memory+time"
    assert all(m.figures == "memory+time" for m in pareto_front(result.measurements, budget))


@pytest.mark.parametrize("measured_elsewhere", [False, True])
def test_a_trial_closed_by_another_worker_is_stored_anew_or_given_up_never_twice(gpt, storage, monkeypatch, caplog,
                                                                                 measured_elsewhere):
    # Another worker judges the running trial stale (its heartbeat stalled) and closes it; it may also measure the
    # configuration again meanwhile. The measurement is stored under a new claim if the configuration is free, else
    # given up with a notice: the search goes on, and no configuration is measured twice.
    import dataclasses

    from autotune.search.store import abandon, distributions, fingerprint, record, start_trial

    space = SearchSpace(("fp32",), (0,), (1, 4))

    class ClosedMeanwhile(Here):
        def run(self, workload, work):
            m, config = super().run(workload, work), work.config
            return closed_meanwhile(m, config)

    def closed_meanwhile(m, config):
        if config.batch_size == 1:
            study = optuna.load_study(study_name="s", storage=storage)
            (running,) = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
            abandon(study, running, "abandoned")
            if measured_elsewhere:
                other = start_trial(study, config, distributions(space), {"worker": "elsewhere:ns:1"})
                key = fingerprint(**{k: v for k, v in dataclasses.asdict(QUICK).items()
                                     if k not in ("timeout_s", "host_budget_bytes")})
                record(study, other, m, {"settings_key": key, "budget_bytes": BUDGET, "timeout_s": None})
        return m

    result = search(gpt, storage, space=space, venue=ClosedMeanwhile("cpu", TensorMeter(budget_bytes=BUDGET)))
    trials = optuna.load_study(study_name="s", storage=storage).get_trials(deepcopy=False)
    measured = [t for t in trials if "measurement" in t.user_attrs]
    assert sorted(t.params["batch_size"] for t in measured) == [1, 4]  # once each
    assert [t.user_attrs["worker"] == "elsewhere:ns:1" for t in measured] == [measured_elsewhere, False]
    assert result.n_run == (1 if measured_elsewhere else 2) and len(result.measurements) == 2
    assert ("measurement is given up" in caplog.text) is measured_elsewhere


def test_the_search_freezes_the_heap_it_starts_with_and_leaves_it_as_it_found_it(gpt, storage, monkeypatch):
    import gc

    frozen = []

    class Noting(Here):
        def run(self, workload, work):
            frozen.append(gc.get_freeze_count())
            return super().run(workload, work)

    space = SearchSpace(("fp32",), (0,), (1,))
    gc.unfreeze()  # as a user's process is (the suite's conftest freezes its own)
    try:
        search(gpt, storage, space=space, study="a", venue=Noting("cpu", TensorMeter(budget_bytes=BUDGET)))
        assert frozen[0] > 0 and gc.get_freeze_count() == 0  # frozen during the trials, not after
        gc.freeze()  # a process that froze its heap itself keeps it frozen
        search(gpt, storage, space=space, study="b", venue=Noting("cpu", TensorMeter(budget_bytes=BUDGET)))
        assert gc.get_freeze_count() > 0
    finally:
        gc.collect()
        gc.freeze()

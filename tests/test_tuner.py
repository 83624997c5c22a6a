"""The tuner's stages, each on its own typed input and output, and the CUDA-path defects they fix."""

import dataclasses
import gc
import signal
import sys
import textwrap
import weakref

import pytest
import torch

import autotune
from autotune import tuner
from autotune.errors import UsageError
from autotune.options import Options
from autotune.records import Config
from autotune.units import format_bytes
from tests import procs

TINY = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def _options(tmp_path, **kwargs):
    base = dict(model="autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget="64MiB", precisions="fp32",
                segments="0,2", batch_sizes="2,4", measure_steps=2, storage=f"sqlite:///{tmp_path}/t.db", study="t",
                probe=False, compare_library=False)
    return Options(**{**base, **kwargs})


def test_resolve_reads_the_options_against_this_machine(tmp_path):
    target = tuner.resolve(_options(tmp_path, budget=None, budgets="32MiB"))
    assert target.device == torch.device("cpu") and target.isolation == "none"
    assert target.budget.bytes == 32 * 2**20 and target.budget.extra == () and target.budget.enforced == 32 * 2**20
    assert target.precisions == ("fp32",) and target.data_profile is None
    assert any("no --data" in n for n in target.notices)
    whole = tuner.resolve(_options(tmp_path, budget=None))
    assert whole.budget.bytes == whole.backend.total_bytes()  # no budget: the device's memory


def test_resolve_finds_the_worst_batch_of_every_size(tmp_path):
    target = tuner.resolve(_options(tmp_path, data="tests.models:tiny_variable_loader", model_kwargs={**TINY, "block_size": 64}))
    assert set(target.workload.worst_batches) == {2, 4} and target.data_profile["items"] == 640


def test_preflight_builds_the_model_once_and_lets_it_go(tmp_path, monkeypatch):
    built = []
    from autotune.training.workload import Workload

    original = Workload.build_model

    def tracked(self):
        model = original(self)
        model.me = [model]  # a reference cycle, as Hugging Face models and --fp32-modules wrappers have
        built.append(weakref.ref(model))
        return model

    monkeypatch.setattr(Workload, "build_model", tracked)
    gc.disable()  # only the preflight may collect the cycle
    try:
        facts = tuner.preflight(tuner.resolve(_options(tmp_path)))
    finally:
        gc.enable()
    assert facts.model_class == "TinyGPT" and facts.parameter_count > 0 and facts.parameter_bytes == 4 * facts.parameter_count
    assert facts.chain.length == 4 and facts.chain.ordered_by == "forward" and facts.library_checkpointing is None
    assert len(built) == 1 and built[0]() is None  # gone before the trials measure


def test_preflight_refuses_a_budget_below_the_parameters(tmp_path):
    with pytest.raises(autotune.StateDoesNotFit, match="^nothing fits: training the model needs .* weights "):
        tuner.preflight(tuner.resolve(_options(tmp_path, budget="16KiB")))


def test_plan_study_checks_the_plans_and_names_the_study(tmp_path):
    target = tuner.resolve(_options(tmp_path))
    study = tuner.plan_study(target, tuner.preflight(target))
    assert study.name == "t" and study.storage == f"sqlite:///{tmp_path}/t.db"
    assert study.space.plans == ("0", "2") and study.space.blocks == 4
    assert [(c.plan, c.status) for c in study.checks] == [("2", "exact")]
    assert study.workload.chain is not None and not study.compare_library
    again = tuner.plan_study(target, tuner.preflight(target))  # the checks come from the study this time
    assert again.checks == study.checks and again.workload_key == study.workload_key


def test_search_and_analyse_make_the_report_the_stages_describe(tmp_path):
    options = _options(tmp_path)
    target = tuner.resolve(options)
    facts = tuner.preflight(target)
    study = tuner.plan_study(target, facts)
    seen = []
    result = tuner.search(target, facts, study, tuner._Events(None, lambda m, reused: seen.append(m.config), None))
    report = tuner.analyse(target, facts, study, result)
    # every measurement reported as it became known (a memory trial again when its timing completes it)
    assert not result.partial and {m.config for m in result.measurements} == set(seen) and len(seen) >= 2
    assert report.search["space"] == study.space.to_dict() and report.plan_checks == study.checks
    assert report.recommendation is not None
    # where the trials' time went: set-up and steps, summed over the trials, and said in the table
    assert report.search["setup_s"] == pytest.approx(sum(m.setup_s for m in report.trials), abs=1e-3)
    assert report.search["steps_s"] == pytest.approx(sum(m.steps_s for m in report.trials), abs=1e-3)
    assert report.search["steps_s"] > 0
    assert any(line.startswith("search: ") and "setting up" in line for line in report.table().splitlines())
    assert tuner.probe(report, target, study, tuner._Events(None, None, None)) is report  # probe=False: as it was
    tuned = autotune.tune("autotune.examples:TinyGPT", **{f.name: getattr(options, f.name) for f in
                                                            options.__dataclass_fields__.values() if f.name != "model"})
    # run() is these stages: the same trials, reused from the study, and the recommended limit's confirmation's
    confirming = tuned.search["exact_limit"]["trials"]
    assert tuned.trials[:len(tuned.trials) - confirming] == report.trials and confirming in (1, 2)


def test_an_unpicklable_model_with_process_isolation_is_one_clear_line_up_front(tmp_path):
    with pytest.raises(UsageError, match="--isolation none") as info:
        autotune.tune(lambda: torch.nn.Linear(4, 4), device="cpu", isolation="process", budget="1GiB",
                      storage=f"sqlite:///{tmp_path}/l.db")
    assert len(str(info.value).splitlines()) == 1


def test_a_probe_candidate_that_crashes_its_worker_is_rejected_not_the_run(tmp_path):
    # With --isolation process the probe runs in a worker too: this model kills its process after a
    # dozen steps, which the short trials never reach and the probe's epoch does.
    report = autotune.tune("tests.models:DiesInTheProbe", data="tests.models:vectors", device="cpu", isolation="process",
                           budget="1GiB", precisions="fp32", segments="0", batch_sizes="2,4", measure_steps=2,
                           probe_fraction=1.0, probe_top=1, storage=f"sqlite:///{tmp_path}/d.db", study="d")
    assert all(m.status == "ok" for m in report.trials)
    (candidate,) = report.probe
    assert not candidate.accepted and candidate.reason.startswith("crashed: the probe's worker process killed by SIGKILL")
    assert report.recommendation is None
    assert signal.SIGKILL.name in report.table()


def test_a_trial_steps_through_the_users_loop(monkeypatch, tmp_path):
    from autotune.training.applied import Applied
    from autotune.meters import TensorMeter
    from autotune.records import TrialSettings
    from autotune.execution.trial import run_trial
    from autotune.training.workload import Workload

    steps = []
    original = Applied.step
    monkeypatch.setattr(Applied, "step", lambda self, optimizer: steps.append(self.precision) or original(self, optimizer))
    w = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=TINY)
    m = run_trial(w, Config("bf16", "0", 2), device="cpu", meter=TensorMeter(), settings=TrialSettings(measure_steps=3))
    assert m.status == "ok" and steps == ["bf16"] * (1 + 3)  # one metered warm-up step (the state primed), three timed


def test_a_state_that_does_not_fit_is_raised_before_any_trial_with_its_bytes_by_part(tmp_path):
    storage = f"sqlite:///{tmp_path}/s.db"
    with pytest.raises(autotune.StateDoesNotFit) as info:
        autotune.tune("autotune.examples:TinyGPT", device="cpu", budget="6MiB", storage=storage)
    state = info.value.state
    weights = sum(p.numel() * 4 for p in autotune.examples.TinyGPT().parameters())
    assert state["weights"] == state["gradients"] == weights and state["optimizer_state"] > 2 * weights  # moments, steps
    assert info.value.report is None and "\n" not in str(info.value) and "sharded over 3 ranks" in str(info.value)
    assert isinstance(info.value, autotune.NothingFits)
    # SGD holds no state: the weights and gradients alone (4.9 MiB) exceed 4 MiB less headroom, and no optimizer helps
    with pytest.raises(autotune.StateDoesNotFit) as info:
        autotune.tune("autotune.examples:TinyGPT", device="cpu", budget="4MiB", optimizer="torch.optim:SGD",
                      storage=storage)
    assert info.value.state["optimizer_state"] == 0 and "SGD state 0" in str(info.value)
    assert "optimizer that holds less" not in str(info.value)


_LETS_GO = textwrap.dedent("""
    import copy, gc, sys, weakref
    import autotune
    from autotune.examples import TinyGPT

    def train(out):
        model = TinyGPT(**{tiny!r})  # the user's model, and what else their function holds, while it calls tune
        report = autotune.tune(lambda: copy.deepcopy(model), device="cpu", budget="64MiB", precisions="fp32",
                               segments="0", batch_sizes="2", measure_steps=1, storage=f"sqlite:///{{out}}/t.db",
                               study="t", probe=False, compare_library=False)
        assert report.recommendation is not None
        return weakref.ref(model)

    held = train(sys.argv[1])
    gc.collect()
    print("model alive" if held() is not None else "model freed")
""")


def test_tune_lets_go_of_everything_its_caller_held(tmp_path):
    """A fresh process whose first use of autotune is a call inside the user's function: once it returns, the
    user's model is freed. Before, optuna's first import (under that call) kept the ImportError of its optional
    redis backend, whose traceback held every calling frame, model and all, until exit; with a trainer that was
    its DDP wrapper's process group too, whose gloo threads then met the interpreter's finalization."""
    done = procs.run([sys.executable, "-c", _LETS_GO.format(tiny=TINY), str(tmp_path)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "model freed", done.stdout[-2000:]


def _half_frozen():
    from autotune.examples import TinyGPT

    model = TinyGPT(**TINY)
    for block in model.transformer.h[:2]:  # the first two blocks frozen, as a fine-tune does
        block.requires_grad_(False)
    return model


def test_the_state_counts_gradients_and_moments_only_for_the_parameters_that_train(tmp_path):
    facts = tuner.preflight(tuner.resolve(_options(tmp_path, model=_half_frozen, model_kwargs=None)))
    model = _half_frozen()
    weights = sum(p.numel() * 4 for p in model.parameters())
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert 0 < trained < weights
    state = facts.state()
    assert state["weights"] == weights and state["gradients"] == trained
    assert 2 * trained <= state["optimizer_state"] < 2 * trained + 4096  # AdamW's moments (and step counts)
    assert facts.fixed_bytes == sum(state.values())  # one definition: the memory line's and the state check's
    unmeasured = dataclasses.replace(facts, optimizer_state_bytes=None)
    assert unmeasured.state()["optimizer_state"] == 2 * trained  # the guess: AdamW's moments of what trains
    assert facts.trainable_parameter_count == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_a_frozen_model_is_refused_or_admitted_by_the_state_of_what_trains(tmp_path):
    # 700 KiB less 10%: the half-frozen model's state (weights 211 KiB, gradients and AdamW's moments of its 112 KiB
    # that train: 545 KiB) fits, the same model all trained (843 KiB) does not; 400 KiB is too little for either, and
    # the answer gives the trained part's gradients and moments
    tuner.preflight(tuner.resolve(_options(tmp_path, model=_half_frozen, model_kwargs=None, budget="700KiB")))
    with pytest.raises(autotune.StateDoesNotFit):
        tuner.preflight(tuner.resolve(_options(tmp_path, budget="700KiB")))
    with pytest.raises(autotune.StateDoesNotFit) as info:
        tuner.preflight(tuner.resolve(_options(tmp_path, model=_half_frozen, model_kwargs=None, budget="400KiB")))
    trained = sum(p.numel() * 4 for p in _half_frozen().parameters() if p.requires_grad)
    assert info.value.state["gradients"] == trained and 2 * trained <= info.value.state["optimizer_state"] < 2 * trained + 4096
    assert f"gradients {format_bytes(trained)}" in str(info.value)


def test_the_report_names_what_trains_and_counts_its_state_alone(tmp_path):
    report = autotune.tune(_half_frozen, device="cpu", budget="64MiB", precisions="fp32", segments="0", batch_sizes="2",
                           measure_steps=1, storage=f"sqlite:///{tmp_path}/f.db", study="f", probe=False,
                           compare_library=False)
    model = _half_frozen()
    workload = report.workload
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trained = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert (workload["trainable_parameter_count"], workload["trainable_parameter_bytes"]) == (count, trained)
    assert workload["parameter_count"] == sum(p.numel() for p in model.parameters()) > count
    assert workload["fixed_bytes"] == workload["parameter_bytes"] + trained + workload["optimizer"]["state_bytes"]
    line = next(line for line in report.table().splitlines() if line.startswith("trainable: "))
    assert line.startswith(f"trainable: {count:,} of {workload['parameter_count']:,} parameters (") and "AdamW state" in line
    whole = autotune.load(report.to_json(tmp_path / "r.json") and tmp_path / "r.json")
    assert whole.workload["trainable_parameter_count"] == count

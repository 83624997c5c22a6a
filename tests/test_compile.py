"""Compiled training as an axis of the search (``--compile none,default``): measured both ways, failures as outcomes.

A cold CPU compile costs seconds to tens of seconds here: the module compiles one tiny model once (one search, a
module-scoped fixture, its inductor cache in a temporary directory) and reads every assertion from that search.
"""

import os

import pytest

import autotune
from autotune.execution import spawn as isolation
from autotune.execution.trial import TrialWork
from autotune.export import export
from autotune.records import Config, TrialSettings
from autotune.training.workload import Workload

# A cold compile of the search's two graphs (plans 0 and all, forward and backward) takes one to two minutes beside
# the rest of the suite on two cores, and five on a machine loaded four times over: the module's limit is the latter's.
pytestmark = pytest.mark.timeout(900)

TINY = {"n_layer": 2, "block_size": 16, "n_embd": 32, "n_head": 2, "vocab_size": 64}
SEARCH = dict(device="cpu", budget="1GiB", precisions="fp32", segments="0,all", batch_sizes="4,8", strategy="grid",
              compile="none,default", probe=False, compare_library=False, measure_steps=3)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search of TinyGPT eager and compiled, run from an empty working directory; the directory's files after.

    Inductor is made cheaper to start, not other in what a trial measures: scalar kernels (no g++ probe of each
    vector instruction set, about 20 s cold), no precompiled header (it would go to /tmp/torchinductor_<user>,
    not the cache directory), no pool of compile workers left running after the module.
    """
    import torch._dynamo
    import torch._inductor.config as inductor

    work, cache = tmp_path_factory.mktemp("compiled-search"), tmp_path_factory.mktemp("inductor-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        patch.setattr(inductor.cpp, "vec_isa_ok", False)
        patch.setattr(inductor, "cpp_cache_precompile_headers", False)
        patch.setattr(inductor, "compile_threads", 1)
        patch.chdir(work)
        report = autotune.tune("autotune.examples:TinyGPT", model_kwargs=TINY, storage=f"sqlite:///{cache}/s.db",
                               **SEARCH)
    torch._dynamo.reset()
    return report, sorted(os.listdir(work))


def test_every_configuration_is_measured_eager_and_compiled(searched):
    report, _ = searched
    got = {(m.config.plan, m.batch_size, m.config.compile): m for m in report.trials}
    assert set(got) == {(p, b, c) for p in ("0", "all") for b in (4, 8) for c in ("none", "default")}
    assert all(m.status == "ok" for m in got.values()), [(k, m.error) for k, m in got.items() if m.status != "ok"]
    for (_, _, compile), m in got.items():
        if compile == "none":
            assert m.memory_source == "tensor" and m.compile_s is None and m.compiles is None
        else:  # the CPU allocator's events see what compiled kernels allocate; the compile's figures are recorded
            assert m.memory_source == "allocator" and m.compiles is not None and m.graph_breaks is not None
            assert m.compile_s is not None and m.compile_s >= 0 and m.setup_s >= m.compile_s
    data = report.to_dict()
    assert {t["compile"] for t in data["trials"]} == {"none", "default"}
    assert data["search"]["space"]["compile"] == ["none", "default"]
    assert {(r["segments"], r["compile"]) for r in data["limits"]} == {(p, c) for p in ("0", "all")
                                                                         for c in ("none", "default")}


def test_a_variant_compiles_at_most_twice_in_a_search(searched):
    report, _ = searched
    for plan in ("0", "all"):
        compiled = [m for m in report.trials if m.config.plan == plan and m.config.compiled]
        assert sum(m.compiles for m in compiled) <= 2, [(m.batch_size, m.compiles) for m in compiled]


def test_plans_are_checked_compiled_against_compiled(searched):
    report, _ = searched
    checks = {(str(c.plan), c.compile): c for c in report.plan_checks}
    assert {("all", "none"), ("0", "default"), ("all", "default")} <= set(checks)
    compile_check, plan = checks["0", "default"], checks["all", "default"]
    assert compile_check.ok and compile_check.compile_diff is not None  # what compile itself changes, recorded
    assert plan.ok, plan.describe()  # a plan may not change the compiled step more than compiling it does
    assert plan.tolerance >= 8 * compile_check.compile_diff


def test_the_table_and_the_recommendation_say_whether_to_compile(searched):
    report, _ = searched
    table = report.table()
    assert "compile" in table.splitlines()[0] and "compiled" in table
    assert "budget judged after each step" in table
    rec = report.recommendation
    assert rec is not None
    line = next(line for line in table.splitlines() if line.startswith("recommendation:"))
    assert ("compiled (torch.compile)" in line) == rec.config.compiled


def test_a_compiled_recommendation_is_applied_and_exported_compiled(searched):
    report, _ = searched
    data = report.to_dict()
    best = next(t for t in data["trials"] if t["compile"] == "default" and t["status"] == "ok")
    model = autotune.examples.TinyGPT(**TINY)
    run = autotune.apply(model, {**data, "recommendation": best})
    assert run.compile == "default" and run.model is not model  # torch.compile's module, the same parameters
    assert {id(p) for p in run.model.parameters()} == {id(p) for p in model.parameters()}
    hf = export(autotune.Report.from_dict({**data, "recommendation": best}), "hf")
    assert hf["training_arguments"]["torch_compile"] is True and hf["autotune_recommendation"]["compile"] == "default"
    loop = export(autotune.Report.from_dict({**data, "recommendation": best}), "lightning")
    assert any("torch.compile(model)" in note for note in loop["notes"])


def test_no_compile_cache_lands_in_the_working_directory(searched):
    _, files = searched
    assert files == [], files


def test_a_model_that_does_not_compile_gets_a_notice_and_its_eager_search_is_kept(tmp_path):
    report = autotune.tune("tests.models:DoesNotCompile", storage=f"sqlite:///{tmp_path}/s.db",
                           **{**SEARCH, "segments": "0", "batch_sizes": "2,4"})
    assert any("does not compile" in n and "eager ones are" in n for n in report.notices), report.notices
    assert report.search["space"]["compile"] == ["none"]
    assert {m.config.compile for m in report.trials} == {"none"} and all(m.status == "ok" for m in report.trials)
    check = next(c for c in report.plan_checks if c.compile == "default")
    assert not check.ok and "torch.compile failed" in check.error


def test_a_compile_that_hangs_is_killed_at_the_trial_time_limit(monkeypatch):
    monkeypatch.setattr(isolation, "STARTUP_GRACE_S", 5.0)
    work = TrialWork(Config("fp32", "0", 2, "default"), TrialSettings(measure_steps=2, timeout_s=5.0), None)
    m = isolation.Spawned("cpu").run(Workload.from_specs("tests.models:CompileHangs"), work)
    assert m.status == "timeout" and "killed" in m.error
    assert m.config.compile == "default"


def test_a_meter_that_cannot_see_compiled_code_is_refused_for_a_compiled_trial():
    from autotune.execution.trial import run_trial
    from autotune.meters import TensorMeter

    with pytest.raises(autotune.UsageError, match="cannot measure compiled training"):  # it would measure eager
        run_trial(Workload.from_specs("tests.models:DoesNotCompile"), Config("fp32", "0", 2, "default"), device="cpu",
                  meter=TensorMeter())


def test_a_compile_mode_is_one_of_torch_compiles():
    with pytest.raises(autotune.UsageError, match="unknown --compile mode fastest"):
        autotune.tune("tests.models:DoesNotCompile", compile="none,fastest")
    assert Config("fp32", "0", 2, "max-autotune-no-cudagraphs").compiled

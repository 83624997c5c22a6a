"""Compiled training as an axis of the search (``--compile none,default``): measured both ways, failures as outcomes.

A cold CPU compile costs seconds to tens of seconds here: the module compiles one tiny model once (one search, a
module-scoped fixture, its inductor cache in a temporary directory) and reads every assertion from that search.
"""

import os

import pytest
import torch

import autotune
from autotune.execution import spawn as isolation
from autotune.execution.plan_check import COMPILED_TOLERANCE
from autotune.execution.trial import TrialWork
from autotune.export import export
from autotune.records import Config, TrialSettings
from autotune.training.workload import Workload
from tests.inductor import cheap_inductor
from tests.models import BatchNormDropout, NoChain
from tests.paths import ROOT

# A cold compile of the search's two graphs (plans 0 and all, forward and backward) takes one to two minutes beside
# the rest of the suite on two cores, and five on a machine loaded four times over: the module's limit is the latter's.
pytestmark = pytest.mark.timeout(900)

# Two residual blocks with BatchNorm and dropout (tests/models.py): what a compiled plan must replay exactly (random
# masks, running statistics moved once), in a model that compiles in seconds. TinyGPT's compiled search, 4 blocks, is
# benchmarks/compile.py's (results/compile-cpu.md); tests/meters/test_allocator_meter.py compiles a TinyGPT step.
MODEL = "tests.models:BatchNormDropout"
SEARCH = dict(device="cpu", budget="1GiB", precisions="fp32", segments="0,all", batch_sizes="4,8,16", strategy="grid",
              compile="none,default", probe=False, compare_library=False, measure_steps=3,
              static_compile=False)  # a compile more, for a compiled recommendation: its own test, on a smaller model


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One search of MODEL eager and compiled, run from an empty working directory; the directory's files after.

    Inductor is made cheaper to start, not other in what a trial measures: scalar kernels (no g++ probe of each
    vector instruction set, about 20 s cold), no precompiled header (it would go to /tmp/torchinductor_<user>,
    not the cache directory), no pool of compile workers left running after the module.
    """
    import torch._dynamo

    work, cache = tmp_path_factory.mktemp("compiled-search"), tmp_path_factory.mktemp("inductor-cache")
    with cheap_inductor(cache, workers=True), pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        report = autotune.tune(MODEL, storage=f"sqlite:///{cache}/s.db", **SEARCH)
    torch._dynamo.reset()
    return report, sorted(os.listdir(work))


@pytest.fixture
def cheap_compile(tmp_path):
    """For a test that compiles a small model of its own: the module fixture's cheaper inductor."""
    with cheap_inductor(tmp_path / "inductor-cache", workers=True):
        yield


def test_every_configuration_is_measured_eager_and_compiled(searched):
    report, _ = searched
    got = {(m.config.plan, m.batch_size, m.config.compile): m for m in report.trials}
    assert set(got) == {(p, b, c) for p in ("0", "all") for b in (4, 8, 16) for c in ("none", "default")}
    assert all(m.status == "ok" for m in got.values()), [(k, m.error) for k, m in got.items() if m.status != "ok"]
    for (_, _, compile), m in got.items():
        if compile == "none":
            assert m.memory_source == "tensor" and m.compile_s is None and m.compiles is None
        else:  # the CPU allocator's events see what compiled kernels allocate; the compile's figures are recorded
            assert m.memory_source == "allocator" and m.compiles is not None
            assert m.graph_breaks == 0  # plan all's recomputed blocks too: traced into the graph, not run eager
            assert m.compile_s is not None and m.compile_s >= 0 and m.setup_s >= m.compile_s
    data = report.to_dict()
    assert {t["compile"] for t in data["trials"]} == {"none", "default"}
    assert data["search"]["space"]["compile"] == ["none", "default"]
    assert {(r["segments"], r["compile"]) for r in data["limits"]} == {(p, c) for p in ("0", "all")
                                                                         for c in ("none", "default")}


def test_a_variant_compiles_at_most_twice_in_a_search(searched):
    # Three batch sizes, so that a graph compiled per batch size (3) shows. The plan check marks its batch dynamic as
    # a trial does: the graph it compiles serves the trials, which then compile nothing of their own.
    report, _ = searched
    checks = {str(c.plan): c for c in report.plan_checks if c.compile == "default"}
    for plan in ("0", "all"):
        compiled = sorted((m for m in report.trials if m.config.plan == plan and m.config.compiled),
                          key=lambda m: m.batch_size)
        graphs = [checks[plan].compiles] + [m.compiles for m in compiled]  # the check's (fp32, as the trials), theirs
        assert len(compiled) == 3 and graphs[0] >= 1 and sum(graphs) <= 2, graphs
        assert compiled[-1].compiles == 0, graphs


def test_plans_are_checked_compiled_against_compiled(searched):
    report, _ = searched
    checks = {(str(c.plan), c.compile): c for c in report.plan_checks}
    assert {("all", "none"), ("0", "default"), ("all", "default")} <= set(checks)
    compile_check, plan = checks["0", "default"], checks["all", "default"]
    assert compile_check.ok and compile_check.compile_diff is not None  # what compile itself changes, recorded
    assert plan.tolerance == COMPILED_TOLERANCE and plan.noise == 0.0  # compiled steps are deterministic on the CPU
    # Compiled dropout draws other masks than eager dropout: compile changes the step a lot (compile_diff), which is
    # why it sets no tolerance. The plan's recompute under compile draws its blocks' masks again alike and leaves the
    # running statistics as one forward pass moves them: bitwise the compiled step without the plan, buffers compared.
    assert compile_check.compile_diff > 0.1, compile_check
    assert plan.status == "exact" and plan.recomputed_blocks == ("blocks.0", "blocks.1"), plan.describe()
    assert checks["all", "none"].status == "exact"


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
    model = BatchNormDropout()
    run = autotune.apply(model, {**data, "recommendation": best})
    assert run.compile == "default" and run.model is not model  # torch.compile's module, the same parameters
    assert {id(p) for p in run.model.parameters()} == {id(p) for p in model.parameters()}
    # A report recommends from its trials (the fastest that fits, eager or compiled by the timing of the day): the
    # compiled trials alone make a report whose recommendation is compiled.
    compiled = autotune.Report.from_dict({**data, "trials": [t for t in data["trials"] if t["compile"] == "default"]})
    assert compiled.recommendation.config.compiled
    hf = export(compiled, "hf")
    assert hf["training_arguments"]["torch_compile"] is True and hf["autotune_recommendation"]["compile"] == "default"
    loop = export(compiled, "lightning")
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


def test_a_compiled_recommendation_is_timed_again_static_and_the_faster_that_fits_is_recommended(tmp_path, cheap_compile):
    # A model that compiles in seconds, in a worker process kept warm (--isolation process): the plan check and the
    # search's compiled trials share one dynamic graph there (later batch sizes compile nothing), and the stage after
    # the analysis times the recommendation's configuration again beside a static graph at its batch size.
    search = {**SEARCH, "segments": "0", "batch_sizes": "2,4,8", "compile": "default", "static_compile": True,
              "isolation": "process"}
    report = autotune.tune("tests.models:NoChain", storage=f"sqlite:///{tmp_path}/s.db", **search)
    searched = sorted((m for m in report.trials if m.config.compile == "default"), key=lambda m: m.batch_size)
    assert [m.status for m in searched] == ["ok"] * 3 and report.search["workers_started"] == 1, report.search
    assert [m.compiles for m in searched][1:] == [0, 0], [(m.batch_size, m.compiles) for m in searched]
    side = report.search["static_compile"]
    dynamic = next(m for m in report.trials if m.config.compile == "default" and m.batch_size == side["batch_size"])
    static = [m for m in report.trials if m.config.compile == "default+static"]
    assert len(static) == 1 and static[0].status == "ok" and static[0].batch_size == side["batch_size"]
    static = static[0]
    assert static.compiles >= 1  # a graph of its own: dynamic=False is another backend than the search's graph's
    assert static.memory_source == "allocator" and side["static_peak_bytes"] == static.peak_bytes
    assert dynamic.step_s == side["dynamic_step_s"]  # its timing is the run beside the static one: the two decide
    assert side["static_over_dynamic"] == round(side["static_step_s"] / side["dynamic_step_s"], 4)
    assert report.recommendation.config in {dynamic.config, static.config}  # the faster of the two (both fit)
    assert report.recommendation.samples_per_s == max(dynamic.samples_per_s, static.samples_per_s)
    assert "compiled static (dynamic=False) at batch" in report.table()
    again = autotune.Report.from_dict(report.to_dict())
    assert again.search["static_compile"] == side and {m.config for m in again.trials} == {m.config for m in report.trials}

    data = report.to_dict()
    static_only = autotune.Report.from_dict({**data, "trials": [t for t in data["trials"] if t["compile"] == "default+static"]})
    run = autotune.apply(NoChain(), {**data, "recommendation": static.to_dict()})
    assert run.compile == "default+static"
    # Trained with plain torch.compile (docs/compile.md): a batch of another size compiles one dynamic graph, and a
    # third size none (dynamic=False would compile a graph for every size)
    from autotune.training.compiled import CompileCount

    graphs = []
    for size in (static.batch_size, 3, 5):
        count = CompileCount().start()
        run.model(torch.randn(size, 16)).backward()
        graphs.append(count.graphs)
    assert graphs[2] == 0, graphs
    notes = export(static_only, "lightning")["notes"]
    assert any(f"compiled static (torch.compile(model, dynamic=False)) at batch size {static.batch_size}" in note
               and "drop_last=True" in note for note in notes), notes
    hf = export(static_only, "hf")
    assert hf["training_arguments"]["torch_compile"] is True and "torch_compile_mode" not in hf["training_arguments"]
    assert any("dataloader_drop_last=True" in note for note in hf["notes"]), hf["notes"]

    skipped = autotune.tune("tests.models:NoChain", storage=f"sqlite:///{tmp_path}/s.db",
                            **{**search, "static_compile": False, "isolation": "none"})
    assert "static_compile" not in skipped.search and all(m.config.compile == "default" for m in skipped.trials)


def test_a_static_compile_is_named_mode_plus_static():
    from autotune.vocabulary import compile_label, compile_mode, is_static, parse_compile

    assert parse_compile("none,default+static,max-autotune+static") == ("none", "default+static", "max-autotune+static")
    assert compile_mode("max-autotune+static") == "max-autotune" and is_static("default+static")
    assert compile_label("default+static") == "compiled (static)"
    assert compile_label("max-autotune+static") == "compiled (max-autotune, static)"
    for bad in ("none+static", "fastest+static"):
        with pytest.raises(autotune.UsageError, match="unknown --compile mode"):
            parse_compile(bad)


def test_no_static_timing_where_the_datas_batches_differ_in_shape():
    # A static graph compiles again for every new shape: with --data whose batches may differ in shape (its profile's
    # shapes_vary), the stage leaves the report as searched and says why. No trial runs (no venue is needed).
    from types import SimpleNamespace

    from autotune.refine import static_compile

    report = autotune.load(os.path.join(ROOT, "results", "compile-TinyGPT-cpu.json"))
    assert report.recommendation.config.compiled
    target = SimpleNamespace(data_profile={"shapes_vary": True}, searching=SimpleNamespace(static_compile=True))
    out = static_compile(report, target, study=None, events=None)
    assert out.trials == report.trials and "static_compile" not in out.search
    assert any("not timed static" in n and "differ in shape" in n for n in out.notices), out.notices

"""The time model: each op's work counted alike on real and fake tensors, the cards' table, step times priced and
labelled. No timing is asserted here (timing belongs to benchmarks/time_model.py): the machinery only."""

from __future__ import annotations

import contextlib
import json
import pathlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autotune.errors import UsageError
from autotune.examples import TinyGPT
from autotune.execution.predict import _Predicted, fake_tensors, predict_trial
from autotune.execution.trial import TrialRun, run_trial
from autotune.meters import TensorMeter
from autotune.plans.checkpointing import find_chain
from autotune.records import MEASURED, PREDICTED, Config, Measurement, TrialSettings
from autotune.timing import calibration
from autotune.timing.cards import CARDS_FILE, card, cards
from autotune.timing.counting import StepWork, WorkCounter
from autotune.timing.model import Machine, Rates, card_machine, checked_error, step_time
from autotune.training.workload import Workload
from autotune.vocabulary import Plan, Status
from tests.paths import ROOT

SMALL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32}


def _workload() -> Workload:
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=SMALL)
    return workload.with_chain(find_chain(workload.build_model()))


def _counted(config: Config, *, fake: bool):
    """One step of ``config``'s trial counted: the trial's own code on real tensors, or under the dry run's fake ones."""
    run = (_Predicted if fake else TrialRun)(_workload().unwarmed(), config, torch.device("cpu"), TrialSettings())
    with fake_tensors() if fake else contextlib.nullcontext():
        run.build()
        with WorkCounter() as counter:
            run.step(run.batch)
    run.release()
    return counter.work()


def test_flops_equal_flop_counter_modes_on_a_real_step():
    torch.manual_seed(0)
    model = TinyGPT(**SMALL)
    batch = model.example_batch(4)
    with WorkCounter() as counter:
        model(**batch).loss.backward()
    with FlopCounterMode(display=False) as reference:
        model(**batch).loss.backward()
    assert counter.work().flops == reference.get_total_flops() > 0


def test_a_batched_matmul_is_priced_at_the_rate_of_one_of_its_products():
    """Attention's bmm of many head-sized products runs at a small GEMM's rate, not at the rate of one GEMM of all
    its FLOPs: the rate curve is read at one product's FLOPs."""
    a, b = torch.randn(8, 16, 32), torch.randn(8, 32, 16)
    with WorkCounter() as counter:
        torch.bmm(a, b)
        torch.mm(a[0], b[0])
    bmm, mm = sorted((op for op in counter.work().ops if op.kind == "matmul"), key=lambda op: op.name)
    assert (bmm.name, bmm.matrices, bmm.flops) == ("bmm", 8, 8 * mm.flops) and mm.matrices == 1
    rising = Machine(name="cpu", compute={"matmul": {"fp32": Rates(((1e4, 1e9), (1e6, 1e11)))}},
                     memory={"fp32": Rates(((1.0, 1e15),))}, overhead_s={}, overlapped=False)
    # 8 products of mm's size: 8 times mm's time at mm's rate, not the faster rate of a GEMM of 8x the FLOPs
    assert step_time(StepWork((bmm,)), rising).device_s == pytest.approx(8 * step_time(StepWork((mm,)), rising).device_s)


@pytest.mark.parametrize("plan", ["0", "all"])
def test_a_real_step_and_its_prediction_count_the_same_work(plan):
    config = Config("fp32", Plan(plan), 4)
    real, fake = _counted(config, fake=False), _counted(config, fake=True)
    phases, predicted = real.totals(), fake.totals()
    assert phases.keys() == predicted.keys()
    for phase, row in phases.items():  # the real step reads its loss (.item(): one op, 4 bytes) where a fake one cannot
        assert row["flops"] == predicted[phase]["flops"], phase
        assert abs(row["bytes"] - predicted[phase]["bytes"]) <= 16 and abs(row["ops"] - predicted[phase]["ops"]) <= 2
    assert phases["forward"]["flops"] > 0 and phases["backward"]["flops"] == 2 * phases["forward"]["flops"]
    assert phases["optimizer"]["ops"] > 0 and phases["optimizer"]["flops"] == 0
    if plan == "all":  # every block's forward again in the backward pass: its matmuls, less the head's
        assert 0 < phases["recompute"]["flops"] < phases["forward"]["flops"]
    else:
        assert "recompute" not in phases


def test_cards_table_has_every_card_with_its_sources():
    required = {"h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "l4", "l40s", "a10g", "rtx3090", "rtx4090",
                "v100", "mi300x"}
    table = cards()
    assert required <= set(table)
    for name, c in table.items():
        assert name == name.lower() and " " not in name
        assert c.peak_flops["fp32"] > 0 and c.peak_flops["fp16"] > 0
        assert c.memory_bytes > 0 and c.memory_bytes_per_s > 0 and c.host_link_bytes_per_s > 0
        assert "https://" in c.source and c.title
    assert json.loads(CARDS_FILE.read_text())["cards"]["v100"]["tflops"]["bf16"] is None  # no such unit: not made up
    assert card("RTX4090").capability == (8, 9)
    with pytest.raises(UsageError, match="choose one of a100-40gb, a100-80gb"):
        card("rtx9090")


def _machine() -> Machine:
    flat = Rates(((1.0, 1e10), (1e12, 1e10)))
    return Machine(name="test", compute={"matmul": {"fp32": flat}}, memory={"fp32": flat},
                   overhead_s={"forward": 1e-6, "backward": 1e-6, "optimizer": 1e-6}, overlapped=False)


@pytest.mark.parametrize("machine", [_machine(), card_machine(card("h100-sxm"))], ids=["cpu-like", "h100-sxm"])
def test_predicted_step_time_grows_with_the_batch_and_is_labelled(machine):
    workload = _workload()
    times = []
    for b in (1, 4, 16):
        m = predict_trial(workload, Config("fp32", Plan("0"), b), time_model=machine)
        assert m.status == Status.OK and m.time_source == PREDICTED and m.time_model == machine.name
        assert m.samples_per_s == pytest.approx(b / m.step_s)
        times.append(m.step_s)
        back = Measurement.from_dict(m.to_dict())
        assert back.time_source == PREDICTED and back.time_model == machine.name
    assert times == sorted(times)  # never faster with more samples; strictly slower where the host does not hide it
    assert times[0] < times[1] < times[2] or machine.overlapped
    plain = predict_trial(workload, Config("fp32", Plan("0"), 4))  # no time model: memory only, as before
    assert plain.step_s is None and plain.time_source == ""


def test_recomputing_and_offloading_cost_time():
    workload, machine = _workload(), _machine()
    seconds = {plan: predict_trial(workload, Config("fp32", Plan(plan), 8), time_model=machine).step_s
               for plan in ("0", "all", "0+offload")}
    assert seconds["0"] < seconds["all"] and seconds["0"] < seconds["0+offload"]


def test_a_measured_trial_is_labelled_measured():
    m = run_trial(_workload(), Config("fp32", Plan("0"), 2), device="cpu", meter=TensorMeter("cpu"),
                  settings=TrialSettings(measure_steps=1, settle_steps=0, timeout_s=None))
    assert m.status == Status.OK and m.time_source == MEASURED and m.time_model is None


def test_the_cpus_calibration_is_read_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    machine = _machine()
    path = calibration.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration._to_json(machine)))
    read = calibration.this_cpu()  # no calibration: the cache answers
    assert read.compute == machine.compute and read.memory == machine.memory and read.overhead_s == machine.overhead_s
    assert str(tmp_path) in str(path)


def test_a_collective_crosses_the_link_and_a_gpu_overlaps_the_host():
    from autotune.timing.counting import OpWork, StepWork

    machine = card_machine(card("a100-80gb"))
    compute = OpWork("forward", "matmul", "bf16", 10**12, 10**6, 1, "mm")
    reduce = OpWork("backward", "collective", "fp32", 0, 10**10, 1, "allreduce_")
    alone = step_time(StepWork((compute,)), machine, world_size=8)
    both = step_time(StepWork((compute, reduce)), machine, world_size=8)
    assert both.step_s > alone.step_s  # 10 GB all-reduced over NVLink takes longer than the matmul hides
    assert alone.step_s == pytest.approx(max(alone.device_s, alone.host_s))


def test_the_checked_error_is_the_committed_benchmarks():
    checked = checked_error("cpu")
    results = ROOT / "results" / "time_model-cpu.json"
    if checked is None:
        assert not results.exists()
        return
    figures = json.loads(results.read_text())["all"]
    assert checked["median_abs_error"] == round(figures["median_abs_error"], 4)
    assert checked["spearman"] == round(figures["spearman"], 4)


def test_this_cpus_calibration_is_cached_per_thread_count_and_read_back(tmp_path, monkeypatch):
    from autotune.timing import calibration

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    path = calibration.cache_path()
    assert path.parent == tmp_path and path.name.startswith("cpu-")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert calibration.cache_path() != path  # another thread count: another calibration
    finally:
        torch.set_num_threads(threads)
    cached = calibration.this_cpu()  # calibrated now (seconds), then read from the file
    assert path.exists() and calibration.this_cpu() == cached


def test_the_calibration_trains_as_models_do():
    """Dropout's random draws and the fused attention's math path that dropout takes are measured ops, not priced as
    bandwidth alone (``python benchmarks/time_per_op.py gpt2`` shows GPT-2's and BERT's dropouts); this CPU's cached
    calibration, the one every search here reads."""
    machine = calibration.this_cpu()
    assert {"bernoulli_/fp32", "bernoulli_/bf16", "_safe_softmax/fp32"} <= set(machine.factors)
    assert machine.factors["bernoulli_/fp32"] > 3  # a random number per element: far above an add's bandwidth


@pytest.mark.parametrize("device_name, card", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("Tesla V100-SXM2-16GB", "v100"), ("AMD Instinct MI300X", "mi300x"), ("NVIDIA GeForce GTX 1080", None)])
def test_a_gpus_own_name_finds_its_card(device_name, card):
    from autotune.timing.cards import card_named, cards

    assert card_named(device_name) == card and (card is None or card in cards())


def test_a_rate_lost_in_the_dispatch_is_left_out_of_the_curve():
    """An op that takes no longer than its dispatch says nothing of its rate (its FLOPs over what is left of its time
    gave 65 TFLOP/s for a 32x32 matmul): the calibration leaves it out, and smaller sizes take the smallest rate kept."""
    a = torch.randn(32, 32)
    assert calibration._rate(lambda: torch.mm(a, a), dispatch_s=1.0, flops=True) is None  # a second's dispatch
    kept = calibration._rate(lambda: torch.mm(a, a), dispatch_s=0.0, flops=True)
    assert kept is not None and kept[0] == 2 * 32 ** 3
    curve = calibration._curve([None, (1e6, 2e9), (1e4, 1e9)])
    assert curve.points == ((1e4, 1e9), (1e6, 2e9)) and curve.at(10.0) == 1e9

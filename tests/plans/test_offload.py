"""Activation offload (``PLAN+offload``, ``--offload``): exact, lighter on the device, counted and bounded on the host.

On the CPU the offload is emulated (autotune/plans/offload.py): the host copies are made outside
the tensor meter, so the device peak a trial reports drops and ``host_peak_bytes`` holds what moved.
The CUDA path (pinned memory, a side stream, prefetch) runs in benchmarks/gpu_check.py.
"""

import copy
import json

import pytest
import torch

import autotune
from autotune.__main__ import main
from autotune.errors import is_oom
from autotune.meters import TensorMeter
from autotune.vocabulary import Plan, plan_order, with_offload
from autotune.execution.plan_check import check_plans
from autotune.plans.checkpointing import apply_plan, find_chain, remove_plan
from autotune.plans.offload import HostBudgetExceededError, offloader_of
from autotune.training.workload import Workload
from tests.fake_cuda import FakeStreams
from tests.paths import ROOT

TINY = '{"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}'
QUICK = ["--device", "cpu", "--warmup-steps", "2", "--measure-steps", "2"]
MODELS = {  # a transformer, and a CNN with BatchNorm
    "TinyGPT": ("autotune.examples:TinyGPT", {"n_layer": 4, "block_size": 64, "n_embd": 64, "n_head": 4}),
    "ResNetish": ("autotune.examples:ResNetish", None),
}


def test_offloaded_plans_are_named_by_their_base_plan():
    plan = Plan(" 4 + OFFLOAD ")
    assert plan == "4+offload" and plan.offload and plan.base == "4" and not plan.off
    assert plan.blocks(12) == Plan("4").blocks(12) and plan.recompute_share(12) == Plan("4").recompute_share(12)
    assert Plan("0+offload").base.off and not Plan("0+offload").off  # it changes the model: checked, applied
    assert Plan("sac-linear+offload").selective == Plan("sac-linear").selective
    assert Plan("every4+offload").every == 4 and Plan("all+offload").label == "all blocks, offloaded"
    assert with_offload(["0", "all"], ["none", "activations"]) == ("0", "all", "0+offload", "all+offload")
    assert with_offload(["0", "all"], ["activations"]) == ("0+offload", "all+offload")
    assert plan_order(["all+offload", "0", "all", "0+offload"], 12) == ["0", "0+offload", "all", "all+offload"]
    # A failure for the host's memory implies nothing of another plan, nor another plan's failure of this one
    assert not Plan("all+offload").needs_no_more_memory_than("all", 12)
    assert not Plan("all").needs_no_more_memory_than("all+offload", 12)
    assert not Plan("all+offload").needs_no_more_memory_than("4+offload", 12)
    assert Plan("4+offload").needs_no_more_memory_than("4+offload", 12)


def _step(workload, model, batch):
    """One metered fp32 step: its device peak, the host peak, and the loss, gradients and buffers."""
    meter = TensorMeter("cpu")
    with meter.measure() as handle:
        handle.track(list(model.parameters()) + list(model.buffers()))
        loss = workload.loss(model, batch)
        loss.backward()
    offloader = offloader_of(model)
    values = {"loss": loss.detach(), **{f"grad:{n}": p.grad for n, p in model.named_parameters() if p.grad is not None},
              **{f"buffer:{n}": b for n, b in model.named_buffers()}}
    return handle.reading.peak_bytes, (offloader.host_peak_bytes if offloader else None), values


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("plan", ["0", "2", "all", "sac-linear"])
def test_an_offloaded_plan_peaks_lower_on_the_device_trains_the_same_and_the_host_holds_the_difference(name, plan):
    spec, kwargs = MODELS[name]
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    built = workload.build_model(seed=0)
    batch = workload.make_batch(built, 16)
    results = {}
    for variant in (plan, plan + "+offload"):
        model = copy.deepcopy(built)
        apply_plan(model, variant, find_chain(model))
        torch.manual_seed(1)  # the same dropout masks
        results[variant] = _step(workload, model, batch)
    (device, host, plain), (device_off, host_off, offloaded) = results[plan], results[plan + "+offload"]
    assert host is None and host_off > 0
    assert device_off < device
    assert device - device_off <= host_off  # what left the device waited on the host, no more
    assert plain.keys() == offloaded.keys()
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain), "offload changed the step"  # bitwise: copies


def test_every_offloaded_plan_passes_the_plan_check_bitwise():
    workload = Workload.from_specs("autotune.examples:ResNetish")
    workload = workload.with_chain(find_chain(workload.build_model(seed=0)))
    checks = check_plans(workload, ["0+offload", "4+offload", "all+offload", "sac-matmul+offload"], batch_size=8,
                         device="cpu")
    assert [c.status for c in checks] == ["exact"] * 4


def test_host_copies_past_the_host_budget_are_the_hosts_out_of_memory():
    workload = Workload.from_specs(MODELS["TinyGPT"][0], model_kwargs=MODELS["TinyGPT"][1])
    model = workload.build_model(seed=0)
    apply_plan(model, "0+offload", find_chain(model), host_budget_bytes=1 << 20)
    offloader = offloader_of(model)
    with pytest.raises(HostBudgetExceededError, match="host memory: activation offload tried to hold") as raised:
        workload.loss(model, workload.make_batch(model, 16)).backward()
    assert is_oom(raised.value) and isinstance(raised.value, torch.OutOfMemoryError)
    assert offloader.host_peak_bytes > 1 << 20  # what the refused copy asked for


def test_remove_plan_takes_the_offload_off_and_the_host_holds_nothing_after_a_step():
    workload = Workload.from_specs(MODELS["TinyGPT"][0], model_kwargs=MODELS["TinyGPT"][1])
    model = workload.build_model(seed=0)
    forward = model.forward
    apply_plan(model, "2+offload", find_chain(model))
    offloader = offloader_of(model)
    workload.loss(model, workload.make_batch(model, 8)).backward()
    assert offloader.moved > 0 and offloader.host_bytes == 0  # freed with the graph
    remove_plan(model)
    assert offloader_of(model) is None and model.forward == forward and "forward" not in model.__dict__
    with torch.no_grad():  # nothing is saved without a backward pass: nothing moves
        apply_plan(model, "0+offload")
        model(**workload.make_batch(model, 2))
        assert offloader_of(model).moved == 0


def test_the_cli_searches_offloaded_plans_on_request_and_apply_trains_with_them(tmp_path, capsys):
    out = tmp_path / "o.json"
    code = main(["--model", "autotune.examples:TinyGPT", "--model-kwargs", TINY, "--budget", "64MiB",
                 "--precisions", "fp32", "--segments", "0,all", "--offload", "none,activations", "--batch-sizes", "32,64",
                 "--strategy", "grid", "--no-probe", "--quiet", "--storage", f"sqlite:///{tmp_path}/s.db",
                 "--out", str(out), *QUICK])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    trials = {(t["segments"], t["batch_size"]): t for t in data["trials"]}
    assert {s for s, _ in trials} == {"0", "all", "0+offload", "all+offload"}
    for (plan, batch), trial in trials.items():
        assert trial["offload"] == ("activations" if Plan(plan).offload else "none")
        if Plan(plan).offload:
            plain = trials[(Plan(plan).base, batch)]
            assert trial["host_peak_bytes"] > 0 and trial["peak_bytes"] < plain["peak_bytes"]
        else:
            assert trial["host_peak_bytes"] is None
    assert data["search"]["host_budget_bytes"] > 0 and data["search"]["host_budget_source"]
    assert {c["plan"]: c["status"] for c in data["plan_checks"]} == {
        "all": "exact", "0+offload": "exact", "all+offload": "exact"}
    assert any("activation offload on the CPU is emulated" in n for n in data["notices"])
    # autotune.apply trains with an offloaded trial as the search did (the report's JSON, that trial recommended)
    trial = next(t for t in data["trials"] if t["segments"] == "all+offload")
    model = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=json.loads(TINY)).build_model(seed=0)
    applied = autotune.apply(model, {**data, "recommendation": trial})
    assert applied.plan["offload"] == "activations" and offloader_of(model) is not None
    assert applied.plan["recomputed_blocks"] == [0, 1, 2, 3]


def test_offload_auto_on_the_cpu_runs_the_space_it_ran_before(tmp_path):
    out = tmp_path / "a.json"
    assert main(["--model", "autotune.examples:TinyGPT", "--model-kwargs", TINY, "--budget", "64MiB",
                 "--precisions", "fp32", "--segments", "0,all", "--batch-sizes", "4", "--strategy", "grid", "--no-probe",
                 "--quiet", "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(out), *QUICK]) == 0
    data = json.loads(out.read_text())
    assert data["search"]["space"]["segments"] == ["0", "all"]
    assert all(t["offload"] == "none" for t in data["trials"]) and "host_budget_bytes" not in data["search"]


@pytest.mark.parametrize("flags, words", [(["--offload", "state"], "run under torchrun with --parallel fsdp"),
                                          (["--offload", "none,activations+state"], "not --parallel none"),
                                          (["--segments", "0,all+state"], "--parallel fsdp"),
                                          (["--segments", "all+cpu"], "no +cpu"),
                                          (["--offload", "disk"], "unknown --offload mode")])
def test_an_offload_mode_that_is_not_searched_is_one_line_and_exit_2(tmp_path, capsys, flags, words):
    code = main(["--model", "autotune.examples:TinyGPT", *flags, "--storage", f"sqlite:///{tmp_path}/s.db", *QUICK])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and words in err


def test_nothing_fits_names_offload_on_cuda_and_sharding_where_the_state_is_most_of_the_budget():
    import dataclasses
    import os

    from autotune.cli.advice import nothing_fits

    def nothing_fits_hint(report):
        return nothing_fits(report.shortfall())

    grid = autotune.load(os.path.join(ROOT, "results",
                                      "grid-TinyGPT-cpu.json"))
    assert "--offload" not in nothing_fits_hint(grid)  # the CPU: device and host are one memory
    on_cuda = dataclasses.replace(grid, environment={**grid.environment, "device_type": "cuda"})
    assert "--offload none,activations" in nothing_fits_hint(on_cuda)
    assert "--parallel fsdp" not in nothing_fits_hint(on_cuda)  # the state is 1% of 1 GiB
    tight = dataclasses.replace(on_cuda, budget_bytes=int(1.5 * grid.workload["fixed_bytes"]))
    assert "sharding the training state" in nothing_fits_hint(tight) and "--parallel fsdp" in nothing_fits_hint(tight)
    assert "--offload none,state" in nothing_fits_hint(tight)
    floor = {"activations": 1000, "block_weights": 24, "precision": "bf16"}
    hosted = dataclasses.replace(tight, workload={**tight.workload, "floor": floor},
                                 search={**tight.search, "space": {**tight.search["space"], "segments": ["0", "0+state"]}})
    said = nothing_fits_hint(hosted)  # the state was searched in host memory already: what the device still needs
    assert "--offload none,state" not in said and "with the state in host memory the activations and the gathered " \
        "block's weights, 1.00 KiB" in said


def test_a_trial_past_its_host_budget_is_an_oom_of_the_host_with_the_bytes_it_asked_for():
    from autotune.execution.trial import run_trial
    from autotune.records import Config, TrialSettings

    spec, kwargs = MODELS["TinyGPT"]
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    workload = workload.with_chain(find_chain(workload.build_model(seed=0)))
    free = run_trial(workload, Config("fp32", "0+offload", 16), device="cpu", meter=TensorMeter(),
                     settings=TrialSettings(measure_steps=1))
    capped = run_trial(workload, Config("fp32", "0+offload", 16), device="cpu", meter=TensorMeter(),
                       settings=TrialSettings(measure_steps=1, host_budget_bytes=free.host_peak_bytes // 2))
    assert free.status == "ok" and capped.status == "oom" and capped.error.startswith("host memory:")
    assert free.host_peak_bytes // 2 < capped.host_peak_bytes <= free.host_peak_bytes
    assert capped.peak_bytes <= free.peak_bytes  # the device did not run out


class _Scaled(torch.nn.Module):
    """A layer multiplying by a tensor its loop changes in place between steps (not a parameter or buffer)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(128, 128)
        self.scale = torch.ones(64, 128)  # 32 KiB x 2: saved by the multiplication, moved

    def forward(self, x):
        return (self.linear(x) * self.scale).square().sum()


def test_a_tensor_that_lives_from_step_to_step_and_changes_between_them_is_moved_again(monkeypatch):
    from autotune.plans import offload

    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)
    x = torch.randn(64, 128)
    grads = {}
    for plan in ("0", "0+offload"):
        torch.manual_seed(0)
        model = _Scaled()
        apply_plan(model, plan)
        for _ in range(2):
            model.zero_grad()
            model(x).backward()
            model.scale.add_(1.0)  # in place, between the steps
        grads[plan] = model.linear.weight.grad
    assert torch.equal(grads["0"], grads["0+offload"])


@pytest.mark.parametrize("plan", ["0+offload", "all+offload"])
def test_on_cuda_copies_run_on_a_side_stream_that_waits_and_is_waited_for_and_backward_prefetches(monkeypatch, plan):
    # CUDA's path with faked streams (tests/fake_cuda.FakeStreams): the tensors stay on the CPU, the calls are logged
    spec, kwargs = MODELS["TinyGPT"]
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    built = workload.build_model(seed=0)
    batch = workload.make_batch(built, 16)
    plain = copy.deepcopy(built)
    apply_plan(plain, plan.split("+")[0], find_chain(plain))
    torch.manual_seed(1)
    _, _, expected = _step(workload, plain, batch)
    model = copy.deepcopy(built)
    apply_plan(model, plan, find_chain(model))
    torch.manual_seed(1)
    with monkeypatch.context() as patch:
        streams = FakeStreams().install(patch)
        streams.as_cuda(patch)
        _, _, got = _step(workload, model, batch)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "offload changed the step"
    moved, log = offloader_of(model).moved, streams.log
    assert moved > 4
    # To the host: into a pinned buffer, on one side stream that first waits for the compute stream (the tensor is
    # made before it is read), the source's memory kept from reuse until the side stream is done with it
    assert [e[1] for e in streams.calls("pinned")] and len(streams.calls("pinned")) == moved
    assert streams.calls("wait_stream") == [("wait_stream", "side1", "compute")] * moved
    assert {e[2] for e in streams.calls("record_stream")} == {"side1", "compute"}
    assert sum(e[2] == "side1" for e in streams.calls("record_stream")) == moved
    # Back to the device: every tensor the backward pass is given was copied back on the side stream, and the compute
    # stream waited for that copy's event (recorded inside the side stream's context), not for the copy to the host
    recorded = {id(e[2]): (i, e[3]) for i, e in enumerate(log) if e[0] == "record_event"}
    waits = [(i, e) for i, e in enumerate(log) if e[0] == "wait_event"]
    assert waits and all(e[1] == "compute" and recorded[id(e[2])][1] for _, e in waits)
    assert all(recorded[id(e[2])][0] < i for i, e in waits)
    assert sum(e[2] == "compute" for e in streams.calls("record_stream")) == len(waits)
    # No copy back is wasted: each one started (prefetched or not) is waited for, that is, given to the backward
    # pass (before, a prefetch copied back again a tensor already given back, and held the copy to the end)
    copies_back = sum(1 for e in streams.calls("record_event") if e[3])
    assert copies_back == len(waits)
    # Prefetch: most copies back were started before the wait that came before theirs (not all: the backward pass
    # reads one node's saved tensors in its own order, not in the reverse of saving; here 42 of 51 and 6 of 7)
    ahead = sum(recorded[id(e[2])][0] < waits[k - 1][0] for k, (_, e) in enumerate(waits) if k)
    assert ahead >= 0.75 * (len(waits) - 1), (ahead, len(waits))


def test_a_parameter_made_during_the_forward_pass_is_not_moved_nor_its_views():
    # FSDP2 registers each block's unsharded parameters as the block's forward begins, after the offload's hooks
    # have read the model's: autograd then saves those parameters (or views of them, as mm saves weight.t())
    model = torch.nn.Linear(2, 2)
    apply_plan(model, "0+offload")
    offloader = offloader_of(model)
    x = torch.randn(128, 128, requires_grad=True)  # 64 KiB: large enough to move
    with offloader.hooks():
        weight = torch.nn.Parameter(torch.randn(128, 128))
        y = torch.mm(x, weight.t())  # saves x and weight.t()
    assert offloader.moved == 1  # x only (it moved both before)
    y.sum().backward()
    assert torch.equal(weight.grad, torch.ones(128, 128).t() @ x.detach())  # dL/dW = (dL/dy)^T x
    assert torch.equal(x.grad, torch.ones(128, 128) @ weight.detach())


def test_an_offloading_plan_trains_under_fsdp2_as_without_its_offload(one_rank_group):
    # FSDP2's sharded parameters are DTensors, whose own storage cannot be read: the offload reads their local
    # shards (before, every step of an offloading plan under --parallel fsdp failed)
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    from autotune.examples import TinyGPT

    load = Workload.from_specs(lambda: TinyGPT(n_layer=2, block_size=32, n_embd=64, n_head=2))
    losses, grads, moved = {}, {}, 0
    for plan in ("0", "0+offload"):
        model = load.build_model(seed=0)
        apply_plan(model, plan, find_chain(model))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss = load.loss(model, load.make_batch(model, 4))
        loss.backward()
        losses[plan], grads[plan] = loss.item(), [p.grad.to_local().clone() for p in model.parameters()]
        moved = offloader_of(model).moved if plan.endswith("offload") else moved
    assert moved > 0 and losses["0"] == losses["0+offload"]
    assert all(torch.equal(a, b) for a, b in zip(grads["0"], grads["0+offload"]))

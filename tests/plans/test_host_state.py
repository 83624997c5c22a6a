"""The training state in host memory (``PLAN+state``: FSDP2's CPUOffloadPolicy), in one process on a one-rank group.

On the CPU it is emulated (autotune/training/host_state.py): the tensor meter is told which tensors are the host's.
The two-rank run is in tests/execution/test_distributed.py (serial); these run in the main suite.
"""

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist

import autotune
from autotune.analysis.memory_model import MemoryModel
from autotune.errors import UsageError
from autotune.examples import TinyGPT
from autotune.execution.job import Job
from autotune.execution.trial import run_trial
from autotune.training.wrapping import Wrapping
from autotune.meters import TensorMeter
from autotune.options import Options
from autotune.vocabulary import Offload, Plan, with_offload
from autotune.plans.checkpointing import find_chain
from autotune.export import export
from autotune.records import Config, Measurement, TrialSettings
from autotune.search.space import SearchSpace
from autotune.search.strategies.view import View
from autotune.training.host_state import wrap_bytes
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload
from tests.export.test_export import QUICKSTART

SETTINGS = TrialSettings(measure_steps=2, settle_steps=0)
_TRIALS = itertools.count(1)


def _workload() -> Workload:
    load = Workload.from_specs(lambda: TinyGPT(n_layer=2, block_size=32, n_embd=64, n_head=2))
    return load.with_chain(find_chain(load.build_model()))


def _trial(load: Workload, plan: str, settings: TrialSettings = SETTINGS, batch_size: int = 8):
    job = Job("fsdp", 0, 1, 0, "gloo")
    job.trials = next(_TRIALS)  # each trial's mesh its own name, as the job's trials have
    return run_trial(load, Config("fp32", plan, batch_size), device="cpu", meter=TensorMeter("cpu"),
                     settings=settings, parallel=Wrapping(job, dist.group.WORLD, torch.device("cpu")))


def _parameter_bytes(load: Workload) -> int:
    return sum(p.numel() * p.element_size() for p in load.build_model().parameters())


def test_the_state_leaves_the_device_for_the_host_and_the_step_trains_the_same(one_rank_group):
    load = _workload()
    params = _parameter_bytes(load)
    plain, host = _trial(load, "0"), _trial(load, "0+state")
    assert plain.status == host.status == "ok", (plain.error, host.error)
    # weights and AdamW's two moments are the host's now; the device keeps the gathered blocks and activations
    assert host.peak_bytes <= plain.peak_bytes - 3 * params * 0.99, (plain.peak_bytes, host.peak_bytes, params)
    # the host holds the weights, the gradients and the moments (each padded shard, one rank: the whole)
    assert abs(host.host_peak_bytes - 4 * params) <= 0.01 * params, (host.host_peak_bytes, params)
    assert plain.host_peak_bytes is None and plain.optimizer_step_share is None
    assert 0 < host.optimizer_step_share < 1 and host.offload == "state"
    assert host.loss_first == plain.loss_first and host.loss_final == plain.loss_final  # the CPU's arithmetic both


def test_activations_and_state_both_offloaded_hold_less_than_the_state_alone(one_rank_group):
    load = _workload()
    state, both = _trial(load, "0+state", batch_size=16), _trial(load, "0+offload+state", batch_size=16)
    assert state.status == both.status == "ok", (state.error, both.error)
    assert both.peak_bytes < state.peak_bytes and both.host_peak_bytes > state.host_peak_bytes
    assert both.loss_final == state.loss_final and both.offload == "activations+state"


def test_a_state_past_the_host_budget_is_the_hosts_out_of_memory(one_rank_group):
    load = _workload()
    small = _parameter_bytes(load) * 2  # the weights fit, the weights and AdamW's moments do not
    m = _trial(load, "0+state", TrialSettings(measure_steps=2, settle_steps=0, host_budget_bytes=small))
    assert m.status == "oom" and m.error.startswith("host memory: the state offload"), m.error


def test_the_user_s_optimizer_state_is_what_the_host_holds(one_rank_group):
    load = _workload()
    sgd = Workload.from_specs(lambda: TinyGPT(n_layer=2, block_size=32, n_embd=64, n_head=2),
                              optimizer="torch.optim:SGD", optimizer_kwargs={"lr": 0.1, "momentum": 0.9})
    params = _parameter_bytes(load)
    m = _trial(sgd.with_chain(load.chain), "0+state")
    assert m.status == "ok" and abs(m.host_peak_bytes - 3 * params) <= 0.01 * params  # weights, grads, momentum


def test_a_state_plan_without_fsdp2_is_refused():
    with pytest.raises(UsageError, match="--parallel fsdp"):
        Trainer(_workload(), Config("fp32", "0+state", 2), torch.device("cpu")).build()
    with pytest.raises(UsageError, match="not --parallel none"):
        Options(model="autotune.examples:TinyGPT", offload="none,state")
    assert Options(model="autotune.examples:TinyGPT", offload="none,state", parallel="fsdp").offload == (Offload.NONE, Offload.STATE)


def test_plan_names_carry_both_offloads_in_one_order():
    assert Plan("ALL+state+offload") == "all+offload+state" == Plan("all+offload+state")
    plan = Plan("sac-linear+offload+state")
    assert (plan.base, plan.without_state, plan.offload_mode, str(plan.offload_mode)) == (
        "sac-linear", "sac-linear+offload", Offload.ACTIVATIONS | Offload.STATE, "activations+state")
    assert (plan.offload, plan.state, [m.suffix for m in plan.modifiers]) == (True, True, ["+offload", "+state"])
    assert Offload.parse("state+activations") is Offload.ACTIVATIONS | Offload.STATE
    assert Plan("0+state").label == "no checkpointing, state on the host" and not Plan("0+state").off
    assert with_offload(["0", "all"], ["none", "state", "activations+state"]) == (
        "0", "all", "0+state", "all+state", "0+offload+state", "all+offload+state")
    with pytest.raises(UsageError, match=r"no \+disk"):
        Plan("all+disk")
    assert not Plan("all+state").needs_no_more_memory_than("0", 4)  # its failures may be the host's


def _ok(plan: str, batch: int, peak: float) -> Measurement:
    return Measurement(Config("fp32", plan, batch), "ok", peak_bytes=int(peak), step_s=0.1, samples_per_s=batch / 0.1)


def test_plans_with_the_state_on_the_host_share_an_intercept_of_their_own():
    # plan 0 holds 100 MB of state on the device, 0+state none of it: all+state's one point takes 0+state's intercept
    measured = [_ok("0", 4, 100e6 + 4e6), _ok("0", 8, 100e6 + 8e6), _ok("0+state", 4, 2e6 + 4e6),
                _ok("0+state", 8, 2e6 + 8e6), _ok("all+state", 8, 2e6 + 2e6)]
    variants = [("fp32", p) for p in ("0", "all", "0+state", "all+state")]
    model = MemoryModel.fit(measured, variants, fixed_bytes_hint=100e6, blocks=4)
    assert abs(model.lines["fp32", "all+state"].fixed_bytes - 2e6) < 1e3
    assert abs(model.lines["fp32", "all"].fixed_bytes - 100e6) < 1e3  # drawn through plan 0's, not the host's
    # all has no point: its per-sample cost is borrowed along plans that keep the state where it keeps it
    assert model.estimate(("fp32", "all"), 8) > 100e6


def test_the_auto_strategy_climbs_plans_with_the_state_on_the_host_apart():
    # Plans that keep the state on the host are no faster for recomputing less than a plan that keeps it on the
    # device: 0+state fits where all does, and must not hide all from the climb (a chain of its own)
    space = SearchSpace(("fp32",), ("0", "all", "0+state", "all+state", "0+offload+state"), (4, 8), blocks=4)
    per_sample = {"0": 1e6, "all": 0.5e6, "0+state": 1e6, "all+state": 0.5e6, "0+offload+state": 0.2e6}
    state = {"0": 10e6, "all": 10e6}  # on the device; the others keep it on the host
    measured = {m.config: m for m in (_ok(p, b, state.get(p, 0) + a * b) for p, a in per_sample.items() for b in (4, 8))}
    envelopes = View(space, measured, None, frozenset()).envelopes("fp32", 12e6)
    assert Config("fp32", "all", 4) in [c for e in envelopes for c in e]
    assert all(len({Plan(c.plan).state for c in e}) == 1 for e in envelopes), envelopes


def _fsdp_report(plan: str):
    """The committed quick start's report, as if its recommendation were ``plan`` under FSDP2 on two ranks."""
    report = autotune.load(QUICKSTART)
    rec = report.recommendation
    trial = dataclasses.replace(rec, config=dataclasses.replace(rec.config, plan=plan))
    return dataclasses.replace(report, trials=(trial,), probe=None,
                               distributed={"wrapper": "fsdp", "world_size": 2, "backend": "nccl"})


def test_exports_ask_each_framework_for_the_state_in_host_memory():
    report = _fsdp_report("all+state")
    hf, accelerate = export(report, "hf"), export(report, "accelerate")
    assert hf["training_arguments"]["fsdp"] == "full_shard auto_wrap offload"
    assert accelerate["fsdp_plugin"]["cpu_offload"] is True
    assert "cpu_offload=True" in " ".join(export(report, "lightning")["notes"])
    assert "offload_optimizer" in " ".join(export(report, "deepspeed")["notes"])
    plain = _fsdp_report("all")
    assert export(plain, "hf")["training_arguments"]["fsdp"] == "full_shard auto_wrap"
    assert "cpu_offload" not in export(plain, "accelerate")["fsdp_plugin"]


def test_apply_prepares_a_state_plan_as_its_plan_and_says_to_wrap_it(caplog):
    load = _workload()
    model = load.build_model()
    applied = autotune.apply(model, Measurement(Config("fp32", "all+state", 4), "ok", peak_bytes=1))
    assert applied.plan["name"] == "all+state" and len(applied.plan["recomputed_blocks"]) == 2
    assert applied.plan["offload"] == "state" and "CPUOffloadPolicy" in caplog.text


def test_a_model_whose_weights_pass_the_budget_trains_with_its_state_on_the_host(one_rank_group):
    # FSDP2 moves and shards one block at a time and the state stays on the host: the device needs one gathered block,
    # the root's parameters and the activations, not the model (on the CPU the build is the host's, not the meter's)
    load = Workload.from_specs(lambda: TinyGPT(n_layer=8, block_size=32, n_embd=64, n_head=2))
    load = load.with_chain(find_chain(load.build_model()))
    weights = _parameter_bytes(load)  # 1.66 MiB, a block 195 KiB
    job = Job("fsdp", 0, 1, 0, "gloo")
    found = {}
    for plan in ("all", "all+state"):
        job.trials = next(_TRIALS)
        found[plan] = run_trial(load, Config("fp32", plan, 2), device="cpu", meter=TensorMeter("cpu", budget_bytes=weights),
                                settings=SETTINGS, parallel=Wrapping(job, dist.group.WORLD, torch.device("cpu")))
    assert found["all"].status == "oom"
    assert found["all+state"].status == "ok", found["all+state"]  # under the budget: the weights


def test_a_released_trainer_lets_its_model_and_optimizer_go(one_rank_group):
    # HostState's gradient hooks and wrapped step hold the model where the garbage collector cannot see a cycle
    import gc
    import weakref

    load = _workload()
    job = Job("fsdp", 0, 1, 0, "gloo")
    job.trials = next(_TRIALS)
    trainer = Trainer(load, Config("fp32", "0+state", 4), torch.device("cpu"),
                      parallel=Wrapping(job, dist.group.WORLD, torch.device("cpu")))
    trainer.build()
    trainer.step(load.make_batch(trainer.module, 4))
    gone = [weakref.ref(trainer.optimizer), weakref.ref(trainer.module)]
    trainer.release()
    trainer.release()  # twice: nothing left to undo
    del trainer
    gc.collect()
    assert [ref() for ref in gone] == [None, None]


def test_the_wrap_s_own_device_peak_counts_on_the_cpu_too(one_rank_group):
    # Under the policy FSDP2 moves each unit to the device whole and makes its padded shard there: the largest unit
    # (here the root's own parameters: no blocks to wrap) and its shard
    load = _workload()
    model = load.build_model()
    weights = _parameter_bytes(load)
    assert wrap_bytes(model, (), 1) == 2 * weights and wrap_bytes(model, (), 4) == weights + weights // 4
    blocks = load.chain.blocks
    block = sum(p.numel() * 4 for p in model.get_submodule(blocks[0]).parameters())
    assert wrap_bytes(model, blocks, 1) == 2 * max(block, weights - len(blocks) * block)
    unwrapped = load.with_chain(None)  # FSDP2 on the root alone: the whole model on the device while it wraps
    m = _trial(unwrapped, "0+state", batch_size=2)
    assert m.status == "ok" and m.peak_bytes >= 2 * weights


def test_plans_named_with_their_offload_are_searched_as_named():
    assert with_offload(["0", "all+state"], ["none"]) == ("0", "all+state")
    assert with_offload(["0", "all+offload"], ["none", "state"]) == ("0", "0+state", "all+offload")


def test_the_memory_line_implies_nothing_of_a_plan_whose_state_is_on_the_host():
    from autotune.analysis.pareto import LineRule, line_failures

    rule = LineRule(600e6)  # the state, on the device for every plan but +state
    trials = [_ok("all+state", 512, 800e6), _ok("all", 512, 1400e6)]
    implied = line_failures(trials, 400e6, [128, 256, 1024], rule)
    assert not [c for c in implied if Plan(c.plan).state] and Config("fp32", "all", 1024) in implied


def test_the_time_bound_of_a_state_plan_comes_from_plans_with_the_state_on_the_host():
    from autotune.search.strategies.auto import step_time_bound

    # plan 0 steps fast on the device; 0+state runs the optimizer on the CPU and is twice as slow
    measured = {m.config: m for m in [_ok("0", 4, 0), _ok("0", 8, 0), _timed("0+state", 4, 0.4), _timed("0+state", 8, 0.8)]}
    measured.update({c: dataclasses.replace(m, step_s=0.2 * c.batch_size / 4, timed=True) for c, m in measured.items()
                     if c.plan == "0"})
    bound = step_time_bound(Config("fp32", "all+state", 8), measured, 4)
    assert bound == pytest.approx(8 / 0.8)  # 0+state's line (k = 0: no recomputing plan timed), not plan 0's (20)


def _timed(plan: str, batch: int, step: float) -> Measurement:
    return Measurement(Config("fp32", plan, batch), "ok", peak_bytes=1, step_s=step, samples_per_s=batch / step)

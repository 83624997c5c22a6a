"""Selective (per-operation) plans: exact like every plan, between no checkpointing and whole blocks in memory."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from autotune.plans.checkpointing import apply_plan, find_chain, remove_plan
from autotune.meters import TensorMeter
from autotune.execution.plan_check import check_plans
from autotune.vocabulary import SELECTIVE, Plan, auto_plans
from autotune.records import Config, TrialSettings
from autotune.plans.selective import make_policy
from autotune.execution.trial import run_trial
from autotune.training.workload import Workload

TINY = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}
aten = torch.ops.aten


def _workload(model="autotune.examples:TinyGPT", **kwargs):
    w = Workload.from_specs(model, model_kwargs=kwargs or None)
    return w.with_chain(find_chain(w.build_model()))


def test_selective_plans_are_named_and_wrap_every_block():
    assert [Plan(n.upper()) for n in SELECTIVE] == list(SELECTIVE)
    assert all(Plan(n).blocks(6) == tuple(range(6)) for n in SELECTIVE)
    assert set(SELECTIVE) - {"sac-torchtitan"} <= set(auto_plans(4))  # searched with the block plans
    assert Plan("SAC-TorchTitan") == "sac-torchtitan" and not SELECTIVE["sac-torchtitan"].auto  # searched where named


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_every_selective_plan_trains_exactly_the_model_without_one(dropout):
    # With dropout the recompute must draw the same masks: the check compares loss, gradients and buffers bitwise.
    checks = check_plans(_workload(**TINY, dropout=dropout), list(SELECTIVE), batch_size=4, device="cpu")
    assert {c.plan: c.status for c in checks} == dict.fromkeys(SELECTIVE, "exact"), [c.describe() for c in checks]


def test_batch_norm_statistics_are_updated_once_under_a_selective_plan():
    checks = check_plans(_workload("autotune.examples:ResNetish"), ["sac-matmul", "sac-lean", "sac-torchtitan"],
                         batch_size=4, device="cpu")
    assert [c.status for c in checks] == ["exact", "exact", "exact"], [c.describe() for c in checks]


def test_selective_plans_sit_between_no_checkpointing_and_whole_blocks():
    w = _workload(**TINY)
    peaks = {}
    for plan in ("0", *SELECTIVE, "all"):
        m = run_trial(w, Config("fp32", plan, 16), device="cpu", meter=TensorMeter(), settings=TrialSettings(measure_steps=1))
        assert m.status == "ok", m.error
        peaks[plan] = m.peak_bytes
        if plan in SELECTIVE:
            assert m.plan["policy"].startswith("keep") and m.plan["recomputed_blocks"] == [0, 1, 2, 3]
    # TinyGPT writes attention out: the (T, T) scores are bmm outputs, kept by sac-matmul, recomputed by sac-linear.
    assert peaks["all"] < peaks["sac-linear"] < peaks["sac-lean"] < peaks["sac-matmul"] < peaks["0"], peaks
    # Its linear layers have biases (addmm) and its attention is bmm: torchtitan's policy keeps none of its outputs
    assert peaks["sac-torchtitan"] == peaks["all"], peaks


def test_torchtitans_policy_alternates_mm_alone_and_keeps_attention_and_amax():
    class Ctx:
        def __init__(self, recompute):
            self.is_recompute = recompute

    keep, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    for recompute in (False, True):  # each pass counts its own mm
        policy = make_policy("sac-torchtitan")
        calls = [aten.mm.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.mm.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default, aten.max.default, aten.abs.default,
                 aten.max.dim, aten.convolution.default, aten.gelu.default]
        assert [policy(Ctx(recompute), f) for f in calls] == [keep, again, again, again, keep, keep, keep, keep,
                                                               again, again, again]


def test_the_lean_policy_keeps_every_other_linear_output_in_both_passes():
    class Ctx:
        def __init__(self, recompute):
            self.is_recompute = recompute

    policy = make_policy("sac-lean")
    forward = [policy(Ctx(False), aten.addmm.default) for _ in range(4)]
    recompute = [policy(Ctx(True), aten.addmm.default) for _ in range(4)]
    keep, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == recompute == [keep, again, keep, again]
    assert policy(Ctx(False), aten.bmm.default) == keep and policy(Ctx(False), aten.gelu.default) == again
    assert make_policy("sac-linear")(Ctx(False), aten.bmm.default) == again  # attention is recomputed
    assert make_policy("sac-matmul")(Ctx(False), aten.convolution.default) == keep


class _ThreeLinears(nn.Module):
    """Three linear layers without a bias (three ``mm`` a call: an odd count, so a count run on from block to block
    would keep other outputs in the second block than in the first)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        return x + self.c(torch.relu(self.b(torch.tanh(self.a(x)))))


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ThreeLinears(), _ThreeLinears()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4, 8)


def test_torchtitans_policy_counts_mm_per_block_call_and_the_recompute_keeps_the_same(monkeypatch):
    import autotune.plans.checkpointing as checkpointing

    made = []  # one list of (pass, kept) per policy, for each mm it decided

    def recording(name):
        policy, decided = make_policy(name), []
        made.append(decided)

        def wrapped(ctx, func, *args, **kwargs):
            out = policy(ctx, func, *args, **kwargs)
            if func is aten.mm.default:
                decided.append(("recompute" if ctx.is_recompute else "forward", out == CheckpointPolicy.MUST_SAVE))
            return out

        return wrapped

    monkeypatch.setattr(checkpointing, "make_policy", recording)
    w = Workload.from_specs(_Stack)
    w = w.with_chain(find_chain(w.build_model()))
    model = w.build_model()
    apply_plan(model, "sac-torchtitan", w.chain)
    w.loss(model, w.make_batch(model, 2)).backward()
    # A fresh policy for each block call (the one made for torch.compile when the plan was applied decides nothing
    # here), keeping the first and third mm of each. torch 2.13 replays the forward's decisions in the recompute
    # without asking the policy again; a torch that asks it (ctx.is_recompute) gets the same from its own count.
    decided = [d for d in made if d]
    forward = [("forward", True), ("forward", False), ("forward", True)]
    assert [[d for d in calls if d[0] == "forward"] for calls in decided] == [forward] * 2, made
    assert all([k for p, k in calls if p == "recompute"] in ([], [True, False, True]) for calls in decided), made
    (check,) = check_plans(w, ["sac-torchtitan"], batch_size=2, device="cpu")
    assert check.status == "exact", check.describe()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)  # changes a kept output in place: a recompute could not give back what the forward used
        return torch.tanh(y)


class _Changes(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 8)


def test_a_policy_the_model_breaks_fails_its_check_loudly():
    w = Workload.from_specs(_Changes)
    w = w.with_chain(find_chain(w.build_model()))
    (check,) = check_plans(w, ["sac-linear"], batch_size=2, device="cpu")
    assert check.status == "failed" and check.error


def test_remove_plan_undoes_a_selective_plan():
    w = _workload(**TINY)
    model = w.build_model()
    before = {p: type(model.get_submodule(p)) for p in w.chain.blocks}
    applied = apply_plan(model, "sac-lean", w.chain)
    assert applied.to_dict()["policy"] and all(type(model.get_submodule(p)) is not before[p] for p in w.chain.blocks)
    remove_plan(model)
    assert {p: type(model.get_submodule(p)) for p in w.chain.blocks} == before  # each block's own class again
    assert not any("_autotune_recompute" in model.get_submodule(p).__dict__ for p in w.chain.blocks)

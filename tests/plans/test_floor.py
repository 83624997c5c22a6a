"""The smallest plan's activations at batch 1 (autotune.plans.floor), and how the state-does-not-fit answer uses them."""

import dataclasses

import pytest
import torch

import autotune
from autotune import tuner
from autotune.options import Options
from autotune.plans.checkpointing import apply_plan, find_chain, remove_plan
from autotune.plans.floor import Floor, measure_floor, state_levers
from autotune.preparation.model import ModelFacts, _check_state_fits

TINY = {"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4, "vocab_size": 64}


def _target(tmp_path, model, budget="1GiB", **kwargs):
    options = Options(model=model, device="cpu", budget=budget, precisions="fp32", probe=False,
                      storage=f"sqlite:///{tmp_path}/w.db", **kwargs)
    return tuner.resolve(options)


@pytest.mark.parametrize("model,kwargs", [("autotune.examples:TinyGPT", TINY), ("autotune.examples:ResNetish", {})])
def test_the_floor_is_about_what_a_trial_of_plan_all_at_batch_1_holds_beyond_the_state(tmp_path, model, kwargs):
    workload = _target(tmp_path, model, model_kwargs=kwargs).workload
    net = workload.build_model()
    batch = workload.make_batch(net, 1)
    floor = measure_floor(net, find_chain(net), lambda: workload.loss(net, batch))
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    assert floor.kept > 0 and floor.recompute > 0 and 0 < floor.block_weights < weights
    apply_plan(net, "all")  # the measurement left no plan behind
    remove_plan(net)
    report = autotune.tune(model, model_kwargs=kwargs, device="cpu", budget="1GiB", precisions="fp32", segments="all",
                           batch_sizes="1", measure_steps=1, probe=False, compare_library=False,
                           storage=f"sqlite:///{tmp_path}/s.db")
    trial = next(m for m in report.trials if m.batch_size == 1)  # the search's (the limit's confirmation ran more)
    beyond_state = trial.peak_bytes - 4 * weights  # weights, gradients, AdamW's two moments
    # Forward passes only: no gradient buffers of activations, no allocator rounding; the same size, within 2x.
    # Counting the parameters, or missing the inputs the recomputed blocks keep, would leave this band.
    assert 0.5 <= beyond_state / floor.activations <= 2, (beyond_state, floor)


def test_a_model_without_blocks_has_the_saved_tensors_of_its_one_plan():
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    x = torch.randn(1, 64)
    floor = measure_floor(net, None, lambda: net(x).sum())
    # what autograd saves: the input of each Linear (the batch's 64 floats, the ReLU's 256), and the ReLU's result
    # (the second Linear's input: one storage); the weights are parameters, not counted
    assert floor == Floor(kept=4 * (64 + 256), recompute=0, block_weights=0)


def test_a_state_that_does_not_fit_still_names_its_levers_when_the_activations_cannot_be_measured(tmp_path):
    target = _target(tmp_path, "autotune.examples:TinyGPT", budget="64KiB", model_kwargs=TINY)
    facts = ModelFacts("TinyGPT", 10_000, 40_000, None, None, optimizer_state_bytes=80_000)  # 40 KB of weights

    def fails() -> Floor:
        raise RuntimeError("running_mean should contain 3 elements")

    with pytest.raises(autotune.StateDoesNotFit) as info:
        _check_state_fits(facts, "torch.optim:AdamW", target, fails)
    message = str(info.value)
    assert "(activations not measured: RuntimeError: running_mean should contain 3 elements)" in message
    assert info.value.floor is None and "sharded over" in message and "\n" not in message


def test_the_ranks_leave_room_for_the_gathered_block_and_batch_1(tmp_path):
    parts = {"weights": 100 * 2**20, "gradients": 100 * 2**20, "optimizer_state": 200 * 2**20}
    floor = Floor(kept=30 * 2**20, recompute=20 * 2**20, block_weights=10 * 2**20, precision="bf16")
    # 400 MiB of state, 160 MiB usable (200 less 20%): 160 - 50 - 10 = 100 MiB of room for state, so 4 ranks
    line = state_levers(parts, "AdamW", False, 200 * 2**20, 0.2, None, floor)
    assert "batch 1 adds 50.00 MiB of activations with every block recomputed (measured here at bf16" in line
    assert "sharded over 4 ranks" in line and "100.00 MiB of state on each" in line
    assert "the weights of the block being computed: 60.00 MiB at batch 1" in line
    # batch 1's activations alone past the usable budget: no lever of the state helps, and the line says so
    big = Floor(kept=150 * 2**20, recompute=20 * 2**20, block_weights=10 * 2**20)
    line = state_levers(parts, "AdamW", False, 200 * 2**20, 0.2, None, big)
    assert "no sharding or state offload fits it; raise --budget" in line and "sharded over" not in line


class _Expert(torch.nn.Module):
    """A block whose work depends on the values (a mixture of experts' routing): fake tensors cannot run it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        rows = torch.nonzero(x.sum(-1) > -1e9).squeeze(-1)  # every row, but only the values can say so
        return torch.relu(self.linear(x[rows]))


class _Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Expert() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def example_batch(self, batch_size):
        return (torch.randn(batch_size, 64), torch.zeros(batch_size, 64))

    def loss(self, output, target):
        return torch.nn.functional.mse_loss(output, target)


@pytest.mark.parametrize("model,kwargs", [("autotune.examples:TinyGPT", None), ("autotune.examples:ResNetish", {})])
def test_fake_tensors_measure_what_the_cpu_measures_without_allocating_it(tmp_path, model, kwargs, caplog):
    from autotune.preparation.model import _floor_of

    workload = _target(tmp_path, model, model_kwargs=kwargs).workload
    real = workload.build_model()
    chain = find_chain(real)
    batch = workload.make_batch(real, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on_cpu = measure_floor(real, chain, lambda: workload.loss(real, batch))
    with caplog.at_level("INFO", logger="autotune"):
        fake = _floor_of(workload, chain, ("fp32", "bf16"), ())
    assert "measured on the CPU" not in caplog.text  # the fake tensors ran it
    assert fake.precision == "bf16" and fake.block_weights == on_cpu.block_weights
    # the same bytes, to a few hundred (fake and real kernels may differ in a small saved statistic)
    assert abs(fake.kept - on_cpu.kept) <= 0.01 * on_cpu.kept and abs(fake.recompute - on_cpu.recompute) <= 0.01 * on_cpu.recompute


def test_a_model_fake_tensors_cannot_run_is_measured_on_the_cpu(tmp_path, caplog):
    from autotune.preparation.model import _floor_of

    workload = autotune.training.workload.Workload.from_specs(_Routed)
    with caplog.at_level("INFO", logger="autotune"):
        floor = _floor_of(workload, find_chain(workload.build_model()), ("fp32",), ())
    assert "batch 1's activations are measured on the CPU (fake tensors could not run the model" in caplog.text
    assert floor.kept > 0 and floor.recompute > 0 and floor.precision == "fp32"


def test_the_state_counted_is_the_smallest_searched_and_the_levers_say_what_each_leaves(tmp_path):
    from autotune.plans.floor import SmallerState

    # 40 KB of weights, as much of gradients, 80 KB of AdamW's moments: 160 KB; in bf16 80 KB; 72 KB usable
    facts = ModelFacts("TinyGPT", 10_000, 40_000, None, None, optimizer_state_bytes=80_000,
                       held={"bf16-true": {"weights": 20_000, "gradients": 20_000, "optimizer_state": 40_000}})
    smaller = SmallerState(true_parts=facts.held["bf16-true"], eight_bit_bytes=20_000, factored_bytes=1_000,
                           adapter_parameters=500, adapter_layers=4, parameters=10_000)
    budget = str(80_000)
    fp32 = tuner.resolve(Options(model="autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget=budget,
                                 precisions="fp32,bf16", probe=False, storage=f"sqlite:///{tmp_path}/a.db"))
    with pytest.raises(autotune.StateDoesNotFit) as info:
        _check_state_fits(facts, "torch.optim:AdamW", fp32, lambda: "not measured", lambda parts: smaller)
    said = str(info.value)
    assert info.value.state == facts.state() and "needs 156.25 KiB before any activation" in said
    assert "--precisions bf16-true holds the weights, gradients and AdamW state in bf16" in said
    assert "19.53 KiB + 19.53 KiB + 39.06 KiB: 78.12 KiB in all, still over 70.31 KiB" in said  # 80 KB > 72 KB
    assert "19.53 KiB of state, 97.66 KiB in all, still over" in said  # 8-bit: weights, gradients and its state
    assert "with bf16-true, 58.59 KiB in all, leaving 11.72 KiB for the activations" in said
    assert "1000 B of state, 79.10 KiB in all, still over" in said  # factored
    assert "500 trained parameters, 5.00% of the model's" in said and "46.88 KiB in all, leaving 23.44 KiB" in said
    assert "no optimizer alone makes it fit" in said
    true = tuner.resolve(Options(model="autotune.examples:TinyGPT", model_kwargs=TINY, device="cpu", budget=str(100_000),
                                 precisions="bf16,bf16-true", probe=False, storage=f"sqlite:///{tmp_path}/b.db"))
    _check_state_fits(facts, "torch.optim:AdamW", true, lambda: "not measured")  # 80 KB of bf16-true's fit in 90 KB
    with pytest.raises(autotune.StateDoesNotFit) as info:  # fp32's 160 KB alone would not
        _check_state_fits(facts, "torch.optim:AdamW", dataclasses.replace(true, precisions=("bf16",)),
                          lambda: "not measured")

"""The user's optimizer: every trial trains with it, its state is in every metered step, priming changes nothing."""

import functools

import pytest
import torch
from torch import nn

from autotune.errors import UsageError
from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings
from autotune.execution.trial import run_trial
from autotune.training.optimizer import OptimizerSpec, prime, state_bytes
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload

from tests.models import TwoHeads

WIDTH = 256  # parameter-heavy: 4 x 256 x 256 weights (1 MiB) against 256 floats of activation a sample


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)))

    def forward(self, x):
        return self.layers(x)

    def example_batch(self, batch_size):
        g = torch.Generator().manual_seed(batch_size)
        return torch.randn(batch_size, WIDTH, generator=g), torch.randn(batch_size, WIDTH, generator=g)

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


class Positional(torch.optim.SGD):
    """SGD with momentum whose constructor needs an argument a parameter group does not carry: no twin can be made."""

    def __init__(self, params, scale):
        super().__init__(params, lr=0.01 * scale, momentum=0.9)


def sgd_factory(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "adafactor": (torch.optim.Adafactor, {}),
    "adamw-foreach": (torch.optim.AdamW, dict(foreach=True, weight_decay=0.1)),
    "adamw-fused": (torch.optim.AdamW, dict(fused=True)),
    "adam-amsgrad": (torch.optim.Adam, dict(amsgrad=True)),
    "rmsprop": (torch.optim.RMSprop, dict(momentum=0.5, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(initial_accumulator_value=0.1)),
}


def workload(optimizer=None, kwargs=None, **more):
    return Workload.from_specs(Wide, optimizer=optimizer, optimizer_kwargs=kwargs, **more)


def trained(spec, *, primed: bool, steps: int = 3):
    """Parameters after ``steps`` steps of a fresh Trainer, primed or not; the ballast held before step 1; the state
    after it."""
    trainer = Trainer(workload(*spec), Config("fp32", "0", 8), torch.device("cpu"))
    trainer.build(prime=primed)
    ballast = state_bytes(trainer.ballast)
    state = None
    for i in range(steps):
        trainer.step(trainer.module.example_batch(8 + i))
        if i == 0:
            assert not trainer.ballast  # given up in the step that makes the real state
            state = state_bytes(t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return [p.detach().clone() for p in trainer.model.parameters()], ballast, state


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_priming_holds_the_state_to_be_and_trains_bitwise_as_a_fresh_optimizer(name):
    # A step on zero gradients at learning rate 0 would not do: SGD's weight decay and dampening fill the momentum
    # buffer, Adagrad starts from its initial value, Adafactor's relative step ignores the learning rate
    primed, ballast, state = trained(OPTIMIZERS[name], primed=True)
    fresh, _, _ = trained(OPTIMIZERS[name], primed=False)
    assert all(torch.equal(a, b) for a, b in zip(primed, fresh))
    assert ballast == state > 0


def test_an_optimizer_without_a_twin_is_primed_by_its_own_steps_and_its_peak_holds_the_state():
    # Positional(params, scale) cannot be rebuilt from a parameter group: trials step until it holds state
    optimizer = Positional(Wide().parameters(), 1.0)
    primed = prime(optimizer)
    assert primed.ballast == [] and isinstance(primed.failure, TypeError)
    settings = TrialSettings(measure_steps=0)
    peaks = {}
    for name, spec in {"positional": (functools.partial(Positional, scale=1.0), None),
                       "sgd": ("torch.optim:SGD", {"lr": 0.01, "momentum": 0.9})}.items():
        m = run_trial(workload(*spec), Config("fp32", "0", 4), device="cpu", meter=TensorMeter("cpu"), settings=settings,
                      timed=False)
        assert m.status == "ok", m.error
        peaks[name] = m.peak_bytes
    # The state is in the peak (no lower than a primed SGD's); its extra steps may add a temporary of a parameter
    largest = max(p.numel() * 4 for p in Wide().parameters())
    assert peaks["sgd"] <= peaks["positional"] <= peaks["sgd"] + largest, peaks


def _peak(spec, batch_size):
    m = run_trial(workload(*spec), Config("fp32", "0", batch_size), device="cpu", meter=TensorMeter("cpu"),
                  settings=TrialSettings(measure_steps=0), timed=False)
    assert m.status == "ok", m.error
    return m.peak_bytes


@pytest.mark.parametrize("name", ["sgd-momentum", "adafactor", "adamw-single", "adamw-foreach"])
def test_one_steps_peak_holds_weights_gradients_the_optimizers_state_and_its_step(name):
    # The trial's peak less the activations (the line through two batch sizes): weights, gradients, the state, and
    # the optimizer step's own temporaries, which the implementation decides: a parameter at a time for the
    # single-tensor loops (the largest one), every parameter at once for foreach (AdamW's list of square roots)
    spec = OPTIMIZERS.get(name, (torch.optim.AdamW, dict(foreach=False)))
    sizes = [p.numel() * 4 for p in Wide().parameters()]
    weights, state = sum(sizes), trained(spec, primed=True, steps=1)[2]
    small, large = _peak(spec, 4), _peak(spec, 8)
    fixed = small - (large - small)
    step = fixed - (2 * weights + state)
    print(f"{name}: fixed part {fixed} B = weights and gradients {2 * weights} + state {state} + step {step}")
    assert 0 <= step <= 3 * max(sizes) + (weights if "foreach" in name else 0)


def test_peaks_move_by_the_state_each_optimizer_keeps():
    # AdamW keeps two moments a parameter, SGD with momentum one, Adafactor a row and a column a matrix; with the
    # single-tensor loops each step's temporaries are a few of one parameter, so the peaks differ by the states
    specs = {"adamw": (torch.optim.AdamW, dict(foreach=False)), "sgd": (torch.optim.SGD, dict(momentum=0.9)),
             "adafactor": (torch.optim.Adafactor, dict(foreach=False))}
    largest = max(p.numel() * 4 for p in Wide().parameters())
    peaks = {name: _peak(spec, 8) for name, spec in specs.items()}
    states = {name: trained(spec, primed=True, steps=1)[2] for name, spec in specs.items()}
    for name in ("sgd", "adafactor"):
        saved, predicted = peaks["adamw"] - peaks[name], states["adamw"] - states[name]
        print(f"{name}: peak {peaks[name]} B, {saved} B under AdamW's {peaks['adamw']}; the states differ by {predicted}")
        assert abs(saved - predicted) <= 3 * largest  # and the steps' temporaries: a few of one parameter, at most


def test_the_optimizer_is_named_and_made_from_a_class_a_factory_or_a_partial():
    assert OptimizerSpec.resolve().name == "torch.optim:AdamW"
    assert workload("torch.optim:SGD", '{"momentum": 0.9}').optimizer.name == "torch.optim:SGD(momentum=0.9)"
    assert workload("torch.optim:SGD").optimizer.name == "torch.optim:SGD"
    assert OptimizerSpec.resolve(torch.optim.SGD, {"lr": 0.1}).name == "torch.optim:SGD(lr=0.1)"
    partial = functools.partial(torch.optim.SGD, lr=0.1)
    assert OptimizerSpec.resolve(partial).name == "torch.optim:SGD(lr=0.1)"
    assert OptimizerSpec.resolve(sgd_factory).name == "tests.training.test_optimizer:sgd_factory"
    made = OptimizerSpec.resolve(sgd_factory).make(Wide(), lr=1.0)
    assert isinstance(made, torch.optim.SGD) and made.defaults["momentum"] == 0.9


@pytest.mark.parametrize("optimizer, kwargs, says", [
    ("torch.optim:NoSuch", None, "has no attribute 'NoSuch'"),
    ("torch.optim:SGD", "{momentum: 0.9}", "--optimizer-kwargs is not valid JSON"),
    ("torch.optim:SGD", "[1]", "must be a JSON object"),
    ("torch.optim:SGD", {"momentum": -1.0}, "raised ValueError when made over the model's parameters"),
    ("torch.nn:Linear", None, "raised TypeError"),
    (lambda params: "not an optimizer", None, "made a str, not a torch.optim.Optimizer"),
])
def test_a_bad_optimizer_is_one_clear_line(optimizer, kwargs, says):
    with pytest.raises(UsageError, match=says):
        workload(optimizer, kwargs).optimizer.make(Wide(), lr=1.0)


def test_an_optimizer_instance_is_refused_with_what_to_pass_instead():
    with pytest.raises(UsageError, match="is an optimizer instance: name its class"):
        OptimizerSpec.resolve(torch.optim.SGD(Wide().parameters(), lr=0.1))


def test_tune_trains_trials_checks_and_the_probe_with_the_users_optimizer_and_step(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from autotune import tune
    from autotune.preparation import describe

    stepped = []
    handle = register_optimizer_step_pre_hook(lambda optimizer, *_: stepped.append(type(optimizer).__name__))
    try:
        report = tune("tests.models:TwoHeads", data="tests.models:two_heads_data", step="tests.models:two_heads_step",
                      optimizer="torch.optim:SGD", optimizer_kwargs='{"lr": 0.01, "momentum": 0.9}', device="cpu",
                      budget="64MiB", precisions="fp32", segments="0", batch_sizes="4,8", strategy="grid",
                      measure_steps=2, storage=f"sqlite:///{tmp_path}/s.db")
    finally:
        handle.remove()
    assert set(stepped) == {"SGD"} and report.probe  # trials, twins and the probe's epoch: SGD only
    assert all(t.status == "ok" for t in report.trials)
    params = report.workload["parameter_bytes"]
    optimizer = report.workload["optimizer"]
    assert optimizer["name"] == "torch.optim:SGD(lr=0.01, momentum=0.9)" and optimizer["state_bytes"] == params
    assert report.workload["fixed_bytes"] == 3 * params and report.workload["step"] == describe("tests.models:two_heads_step")
    # Another optimizer is another study: its trials are not reused for this one
    again = tune("tests.models:TwoHeads", data="tests.models:two_heads_data", step="tests.models:two_heads_step",
                 device="cpu", budget="64MiB", precisions="fp32", segments="0", batch_sizes="4", strategy="grid",
                 measure_steps=2, storage=f"sqlite:///{tmp_path}/s.db", probe=False)
    assert again.search["study"] != report.search["study"] and again.search["n_reused"] == 0
    tensors = len(list(TwoHeads().parameters()))
    assert again.workload["optimizer"]["state_bytes"] == 2 * params + 4 * tensors  # two moments and a step counter


def test_the_state_counts_each_storage_once_and_a_subclass_by_its_inner_tensors():
    from torch.testing._internal.two_tensor import TwoTensor  # a wrapper subclass, as torchao's quantized state is

    shared = torch.zeros(10)  # bitsandbytes' quantization maps: one tensor in every parameter's state
    assert state_bytes([shared, shared.view(2, 5), torch.zeros(3)]) == 4 * 10 + 4 * 3
    pair = TwoTensor(torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
    assert state_bytes([pair]) == 8  # its two inner tensors, not its outer size


def test_twins_in_a_dtype_make_the_state_of_parameters_held_in_it():
    model = Wide()
    optimizer = torch.optim.AdamW(model.parameters())
    primed = prime(optimizer, dtype=torch.bfloat16)
    moments = [t for t in primed.ballast if t.ndim]
    assert primed.failure is None and {t.dtype for t in moments} == {torch.bfloat16}
    assert state_bytes(moments) == 2 * 2 * sum(p.numel() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the model is untouched

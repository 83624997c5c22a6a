import pytest
import torch

from autotune.errors import UsageError
from autotune.training.precision import MODES, get_mode


def test_modes():
    assert get_mode("fp32").autocast_dtype is None and get_mode("fp32").grad_scaler("cpu") is None
    assert get_mode("bf16").autocast_dtype is torch.bfloat16 and get_mode("bf16").grad_scaler("cpu") is None
    scaler = get_mode("fp16").grad_scaler("cpu")
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    with pytest.raises(UsageError, match="fp32, fp16, bf16"):
        get_mode("int8")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_autocast_computes_matmuls_in_the_mode(name):
    lin = torch.nn.Linear(8, 8)
    with MODES[name].autocast("cpu"):
        assert lin(torch.randn(2, 8)).dtype == MODES[name].autocast_dtype
    assert lin(torch.randn(2, 8)).dtype == torch.float32


# --- bf16-fsdp: FSDP2's MixedPrecisionPolicy, the wrapper's precision ------------------------------------------------


def test_bf16_fsdp_is_fsdp2_s_policy_without_autocast_or_scaler():
    mode = get_mode("bf16-fsdp")
    assert mode.autocast_dtype is None and mode.grad_scaler("cpu") is None
    policy = mode.mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert get_mode("bf16").mp_policy() is None and get_mode("fp32").mp_policy() is None
    lin = torch.nn.Linear(8, 8)
    with mode.autocast("cpu"):  # FSDP2 casts, not autocast: an fp32 layer outside FSDP2 stays fp32
        assert lin(torch.randn(2, 8)).dtype == torch.float32


def _fsdp_trainer(precision: str, plan: str = "0"):
    """A Trainer of a small bias-free model under FSDP2 on this process's one-rank gloo group."""
    import torch.distributed as dist

    from autotune.execution.job import Job
    from autotune.plans.checkpointing import find_chain
    from autotune.records import Config
    from autotune.training.trainer import Trainer
    from autotune.training.workload import Workload
    from autotune.training.wrapping import Wrapping

    from tests.plans.test_selective import _Stack

    load = Workload.from_specs(_Stack)
    load = load.with_chain(find_chain(load.build_model()))
    job = Job("fsdp", 0, 1, 0, "gloo")
    return load, Trainer(load, Config(precision, plan, 4), torch.device("cpu"),
                         parallel=Wrapping(job, dist.group.WORLD, torch.device("cpu")))


def test_bf16_fsdp_gathers_and_computes_in_bf16_and_keeps_fp32_shards_gradients_and_state(one_rank_group):
    load, trainer = _fsdp_trainer("bf16-fsdp")
    trainer.build(prime=False)
    seen = []
    for block in trainer.module.blocks:
        block.a.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, args[0].dtype, out.dtype)))
    batch = load.make_batch(trainer.module, 4)
    with trainer.run.autocast():
        loss = load.loss(trainer.model, batch)
    assert not torch.is_autocast_enabled("cpu") and trainer.run.scaler is None
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16)] * 2  # gathered weights, inputs cast, compute
    trainer.run.backward(loss)
    assert {p.grad.dtype for p in trainer.model.parameters()} == {torch.float32}  # the shards' own
    trainer.run.step(trainer.optimizer)
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}  # the sharded parameters
    state = [t for s in trainer.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert state and {t.dtype for t in state} == {torch.float32}  # AdamW's moments over the fp32 shards
    trainer.release()


def test_bf16_fsdp_on_one_rank_trains_what_bf16_weights_compute(one_rank_group):
    """One rank gathers its whole shard: the loss is that of the fp32 model's bf16 copy, bitwise, and each gradient
    that copy's bf16 gradient in fp32 (reduced in fp32 over one rank: the same)."""
    load, trainer = _fsdp_trainer("bf16-fsdp")
    trainer.build(prime=False)
    reference = load.build_model(seed=0)
    for p in reference.parameters():
        p.data = p.data.to(torch.bfloat16)
    batch = load.make_batch(trainer.module, 4)
    loss = load.loss(trainer.model, batch)
    loss.backward()
    expected = load.loss(reference, batch.to(torch.bfloat16))  # FSDP2 casts the root's floating inputs too
    expected.backward()
    assert torch.equal(loss, expected) and loss.dtype == torch.bfloat16
    for (name, p), q in zip(trainer.model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad.full_tensor(), q.grad.float()), name
    trainer.release()


def test_apply_prepares_bf16_fsdp_without_autocast_and_says_how_to_wrap(caplog):
    import autotune
    from autotune.examples import TinyGPT
    from autotune.records import Config, Measurement

    model = TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2)
    run = autotune.apply(model, Measurement(Config("bf16-fsdp", "all", 4), "ok", peak_bytes=1))
    assert run.precision == "bf16-fsdp" and run.scaler is None and run.plan["name"] == "all"
    with run.autocast():
        assert not torch.is_autocast_enabled("cpu")
    assert (run.mp_policy.param_dtype, run.mp_policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert "fully_shard on each block and the root with mp_policy=run.mp_policy" in caplog.text
    assert autotune.apply(TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2),
                          Measurement(Config("bf16", "0", 4), "ok", peak_bytes=1)).mp_policy is None


# --- bf16-true: the model itself in bf16 ----------------------------------------------------------------------------

MODELS = ["autotune.examples:TinyGPT", "autotune.examples:ResNetish"]


def _workload(spec: str):
    from autotune.plans.checkpointing import find_chain
    from autotune.training.workload import Workload

    load = Workload.from_specs(spec)
    return load.with_chain(find_chain(load.build_model()))


def test_bf16_true_casts_the_floating_weights_buffers_and_inputs_and_neither_autocasts_nor_scales():
    from autotune.examples import ResNetish, TinyGPT

    mode = get_mode("bf16-true")
    assert mode.autocast_dtype is None and mode.grad_scaler("cpu") is None and mode.mp_policy() is None
    net = ResNetish()
    weights = list(net.parameters())
    mode.hold(net)
    mode.hold(net)  # prepared twice: one input cast
    assert [id(p) for p in net.parameters()] == [id(p) for p in weights]  # the same parameters, cast
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    buffers = dict(net.named_buffers())
    assert {b.dtype for n, b in buffers.items() if "running" in n} == {torch.bfloat16}
    assert {b.dtype for n, b in buffers.items() if n.endswith("num_batches_tracked")} == {torch.int64}
    images, labels = net.example_batch(2)
    with mode.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
        out = net(images)  # float32 images: cast to bf16 at the forward, as Lightning casts the batch
    assert images.dtype == torch.float32 and out.dtype == torch.bfloat16 and len(net._forward_pre_hooks) == 1
    gpt = TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2)
    tied = [n for n, p in gpt.named_parameters(remove_duplicate=False)]
    mode.hold(gpt)
    assert [n for n, p in gpt.named_parameters(remove_duplicate=False)] == tied  # tied weights stay tied


def _state_by_part(spec: str, precision: str) -> dict[str, int]:
    """One step of a Trainer in ``precision``: the bytes of its weights, gradients, AdamW's moments and step counts
    (the benchmark's measurement, results/true_precision-cpu.md, at batch 4)."""
    from benchmarks.true_precision import state_by_part

    return state_by_part(_workload(spec), precision, batch=4)


@pytest.mark.parametrize("spec", MODELS)
def test_bf16_true_holds_half_the_state_of_bf16_to_the_byte_and_the_preflight_says_so(spec):
    """Weights, gradients and AdamW's moments: half of bf16's (autocast over fp32), to the byte; AdamW's step counts
    are one float32 scalar per parameter either way. The preflight's figure (twins in bf16) is the trial's."""
    from autotune.training.optimizer import OptimizerSpec
    from autotune.training.state import held_parts

    bf16, true = _state_by_part(spec, "bf16"), _state_by_part(spec, "bf16-true")
    assert {k: 2 * v for k, v in true.items() if k != "step_counts"} == {k: v for k, v in bf16.items() if k != "step_counts"}
    assert true["step_counts"] == bf16["step_counts"] > 0
    held = held_parts(_workload(spec).build_model(), OptimizerSpec(), 1e-4, torch.bfloat16)
    assert held == {"weights": true["weights"], "gradients": true["gradients"],
                    "optimizer_state": true["moments"] + true["step_counts"]}


@pytest.mark.parametrize("spec", MODELS)
@pytest.mark.parametrize("plan", ["0", "all"])
def test_bf16_true_trials_are_predicted_to_the_byte(spec, plan):
    from autotune.execution.predict import predict_trial
    from autotune.execution.trial import run_trial
    from autotune.meters import TensorMeter
    from autotune.records import Config, TrialSettings

    load, config = _workload(spec), Config("bf16-true", plan, 8)
    measured = run_trial(load.unwarmed(), config, device="cpu", meter=TensorMeter("cpu"), timed=False,
                         settings=TrialSettings(timeout_s=None))
    predicted = predict_trial(load, config)
    assert measured.status == predicted.status == "ok" and measured.peak_bytes == predicted.peak_bytes


@pytest.mark.parametrize("spec", MODELS)
def test_a_plan_under_bf16_true_is_bitwise_the_plan_free_step(spec):
    """Why plan checks stay in fp32 for bf16-true: a plan's faults do not depend on the dtype, and in bf16 too each plan
    recomputes exactly (fp32 shows a smaller fault than bf16's 8 bits would)."""
    from autotune.execution.plan_check import compare_steps
    from autotune.records import GuardRails
    from autotune.training.applied import prepare

    load = _workload(spec)
    steps = {}
    for plan in ("0", "2", "all", "sac-linear"):
        model = load.build_model(seed=0)
        run = prepare(model, precision="bf16-true", plan=plan, chain=load.chain, guard=GuardRails(),
                      device_type="cpu", micro_batch_size=4)
        loss = load.loss(run.model, load.make_batch(model, 4))
        loss.backward()
        steps[plan] = {"loss": loss.detach().float(), **{f"grad:{n}": p.grad for n, p in model.named_parameters()},
                       **{f"buffer:{n}": b for n, b in model.named_buffers()}}
    assert steps["0"]["loss"].dtype == torch.float32
    assert all(compare_steps(steps["0"], steps[plan]).relative == 0.0 for plan in steps)


def test_apply_casts_the_model_for_bf16_true():
    import autotune
    from autotune.examples import TinyGPT
    from autotune.records import Config, Measurement

    model = TinyGPT(n_layer=2, block_size=8, n_embd=16, n_head=2)
    run = autotune.apply(model, Measurement(Config("bf16-true", "all", 4), "ok", peak_bytes=1))
    assert run.precision == "bf16-true" and run.scaler is None and run.plan["name"] == "all"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    optimizer = torch.optim.AdamW(run.model.parameters(), lr=1e-3)
    with run.autocast():
        loss = run.model(**model.example_batch(4)).loss
    run.backward(loss)
    run.step(optimizer)
    assert {t.dtype for s in optimizer.state.values() for k, t in s.items() if k != "step"} == {torch.bfloat16}


@pytest.mark.parametrize("lr,low,high", [(1e-9, 0.9, 0.99), (1e-1, 0.0, 0.05)])
def test_the_probe_counts_the_updates_bf16_rounds_away(lr, low, high):
    """At a learning rate far below the weights' resolution the sampled updates are lost but for weights at or near
    zero (biases made zero: 2.6% of TinyGPT's samples); far above it, few are."""
    from autotune.records import Config
    from autotune.training.trainer import Trainer

    load = _workload("autotune.examples:TinyGPT")
    trainer = Trainer(load, Config("bf16-true", "0", 4), torch.device("cpu"), lr=lr, record_grad_norm=True)
    trainer.build()
    for i in range(2):
        trainer.step(load.make_batch(trainer.module, 4))
    counted = trainer.lost_updates
    assert counted["sampled"] > 10_000 and low <= counted["share"] <= high, counted
    plain = Trainer(load, Config("bf16", "0", 4), torch.device("cpu"), record_grad_norm=True)
    plain.build()
    plain.step(load.make_batch(plain.module, 4))
    assert plain.lost_updates is None  # fp32 master weights keep every update: nothing to count

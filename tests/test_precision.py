import pytest
import torch

from autotune.errors import UsageError
from autotune.training.precision import PRECISIONS, get_mode


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
    with PRECISIONS[name].autocast("cpu"):
        assert lin(torch.randn(2, 8)).dtype == PRECISIONS[name].autocast_dtype
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

    from tests.test_selective import _Stack

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

"""Every checkpoint plan on a zoo of architectures trains exactly the model it was given.

For each zoo member (tests/zoo.py) and each plan autotune offers for its chain (``auto_plans``, and the selective
plans searched only where named: ``sac-torchtitan``): one fp32
forward and backward pass from the same weights, batch and seed gives a bitwise identical loss,
bitwise identical gradients for every parameter and identical buffers (BatchNorm statistics
included) with the plan as without it. Where the library has a per-layer checkpointing switch of
its own, the plan that recomputes every block ('all') peaks no higher than that switch does.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autotune.plans.checkpointing import _APPLIED, apply_plan, find_chain, order_chain, remove_plan
from autotune.meters import TensorMeter
from autotune.execution.plan_check import check_plans, compare_steps
from autotune.plans import cache, offload
from autotune.plans.offload import offloader_of
from autotune.vocabulary import SELECTIVE, Plan, auto_plans
from autotune.thirdparty import library_checkpointing
from autotune.training.workload import Workload

from tests.optional import needs
from tests.zoo import BY_NAME, ZOO

MEMBERS = [pytest.param(m, id=m.name, marks=m.marks()) for m in ZOO]


def _offered(length: int) -> list[str]:
    """Every plan autotune offers for ``length`` blocks: ``auto``'s, and the selective plans searched where named."""
    return list(dict.fromkeys([*auto_plans(length), *SELECTIVE]))


PLAN_CASES = [pytest.param(m, plan, id=f"{m.name}-{plan}", marks=m.marks()) for m in ZOO for plan in _offered(m.length)]
FORWARD_SEED = 1234  # reseeded right before every forward pass, so dropout draws the same masks


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: as fast on models this small, and no crawl when the machine's two cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _require(member) -> None:
    for package in member.needs:
        needs(package)


@functools.cache
def _setup(name: str):
    """The member's workload, weights, batch and chain (in forward order), shared by all its plans."""
    member = BY_NAME[name]
    workload = Workload.from_specs(member.build)
    torch.manual_seed(0)
    model = workload.build_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    batch = workload.make_batch(model, member.batch_size)
    chain = find_chain(model)
    assert chain is not None, f"no chain found in {name}"
    with torch.no_grad():
        chain = order_chain(model, chain, lambda: workload.loss(model, batch))
    return workload, state, batch, chain


def _build(name: str) -> nn.Module:
    workload, state, _, _ = _setup(name)
    torch.manual_seed(0)
    model = workload.build_model()
    model.load_state_dict(state)
    return model


def _train_step(name: str, model: nn.Module, seed: int = FORWARD_SEED) -> dict[str, torch.Tensor]:
    """One fp32 forward and backward pass: the loss, every gradient and every buffer after it."""
    workload, _, batch, _ = _setup(name)
    torch.manual_seed(seed)
    loss = workload.loss(model, batch)
    loss.backward()
    values = {"loss": loss.detach().clone()}
    for key, p in model.named_parameters():
        values[f"grad:{key}"] = None if p.grad is None else p.grad.detach().clone()
    for key, b in model.named_buffers():
        values[f"buffer:{key}"] = b.detach().clone()
    return values


@functools.cache
def _reference(name: str, cache_off: bool = False) -> dict[str, torch.Tensor]:
    """The step without a plan; ``cache_off``: with the model's key/value cache off in training, as a plan that
    recomputes turns it off (autotune.plans.cache; members are built with their configs' defaults, use_cache on)."""
    model = _build(name)
    if cache_off:
        cache.turn_off(model)
    return _train_step(name, model)


def _reference_for(name: str, plan: str) -> dict[str, torch.Tensor]:
    return _reference(name, cache_off=not Plan(plan).base.off)


def _differences(expected: dict, got: dict) -> list[str]:
    """Every value that is not bitwise identical, with its largest absolute difference."""
    out = []
    for key in dict.fromkeys([*expected, *got]):
        a, b = expected.get(key, "absent"), got.get(key, "absent")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            if a is not b:  # a gradient that is None (or a value that is absent) in one step only
                out.append(f"{key}: {a if not isinstance(a, torch.Tensor) else 'a tensor'} vs "
                           f"{b if not isinstance(b, torch.Tensor) else 'a tensor'}")
        elif a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        elif not torch.equal(a, b):
            if a.is_floating_point():
                delta = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
                out.append(f"{key}: max abs diff {float(delta.max()):.3g} (max |value| {float(a.abs().max()):.3g})")
            else:
                out.append(f"{key}: {int((a != b).sum())} entries differ")
    return out


def _peak(name: str, model: nn.Module) -> int:
    workload, _, batch, _ = _setup(name)
    torch.manual_seed(FORWARD_SEED)
    with TensorMeter().measure() as h:
        h.track(model.parameters())
        h.track(model.buffers())
        workload.loss(model, batch).backward()
    return h.reading.peak_bytes


@pytest.mark.parametrize("member", MEMBERS)
def test_the_chain_holds_the_repeated_blocks(member):
    _require(member)
    model = _build(member.name)
    _, _, _, chain = _setup(member.name)
    assert chain.containers == member.containers
    assert chain.length == member.length
    assert set(chain.block_types) == set(member.block_types)
    assert set(chain.blocks) == set(find_chain(model).blocks)  # forward order is a reordering of definition order
    for path in chain.blocks:
        assert type(model.get_submodule(path)).__name__ in member.block_types, path
        assert path.rpartition(".")[0] in chain.containers, f"{path} is not a direct child of {chain.containers}"
        assert "expert" not in path, f"{path}: the chain went inside a block"
    if member.name == "t5":
        assert chain.length == model.config.num_layers + model.config.num_decoder_layers
        assert chain.blocks == (*(f"encoder.block.{i}" for i in range(3)), *(f"decoder.block.{i}" for i in range(2)))
    if member.name == "cnn_batchnorm":
        assert chain.blocks == tuple(f"stage{s}.{i}" for s in (1, 2, 3) for i in (0, 1))
    if member.name == "bart":
        assert [type(model.get_submodule(p)).__name__ for p in chain.blocks] == ["BartEncoderLayer"] * 2 + ["BartDecoderLayer"] * 3


@pytest.mark.parametrize("member, plan", PLAN_CASES)
def test_every_offered_plan_is_bitwise_exact(member, plan):
    _require(member)
    _, _, _, chain = _setup(member.name)
    assert plan in _offered(chain.length)
    reference = _reference_for(member.name, plan)
    model = _build(member.name)
    applied = apply_plan(model, plan, chain)
    assert applied.recomputed == Plan(plan).blocks(chain.length)
    assert {id(m) for m in model.modules() if m in _APPLIED} == {id(model.get_submodule(chain.blocks[i])) for i in applied.recomputed}
    got = _train_step(member.name, model)
    diffs = _differences(reference, got)
    assert not diffs, f"plan {plan} on {member.name} is not bitwise exact:\n  " + "\n  ".join(diffs[:15])
    for key, value in got.items():  # batch norm statistics moved, once: the comparison of buffers means something
        if key.endswith("num_batches_tracked"):
            assert int(value) == 1, key
    remove_plan(model)
    assert not [m for m in model.modules() if m in _APPLIED]


@pytest.mark.parametrize("member", [p for p in MEMBERS if p.values[0].library])
def test_all_peaks_no_higher_than_the_library_switch(member):
    _require(member)
    _, _, _, chain = _setup(member.name)
    plain = _peak(member.name, _build(member.name))
    model = _build(member.name)
    apply_plan(model, "all", chain)
    ours = _peak(member.name, model)
    model = _build(member.name)
    assert library_checkpointing(model) is not None
    library = _peak(member.name, model)
    assert ours <= library, f"{member.name}: plan 'all' peaks at {ours} bytes, the library's switch at {library} (none: {plain})"
    assert ours < plain, f"{member.name}: plan 'all' peaks at {ours} bytes, no checkpointing at {plain}"


def test_the_comparison_sees_what_a_plan_could_get_wrong():
    """The harness is sensitive: a recompute that moves batch norm twice, or other dropout masks, are caught."""
    import contextlib

    name = "cnn_batchnorm"
    model = _build(name)
    apply_plan(model, "all", _setup(name)[3], contexts=lambda call: (contextlib.nullcontext(), contextlib.nullcontext()))
    diffs = _differences(_reference(name), _train_step(name, model))
    assert any("num_batches_tracked" in d for d in diffs) and any("running_mean" in d for d in diffs)
    assert not any(d.startswith(("loss", "grad:")) for d in diffs)

    name = "dropout_experts"
    other_masks = _train_step(name, _build(name), seed=FORWARD_SEED + 1)
    assert not torch.equal(other_masks["loss"], _reference(name)["loss"])


# --- Members with something to show of their own --------------------------------------------------


CACHED = ["gpt2", "llama", "llama_lora", "t5"]  # built with their configs' defaults, use_cache on: each caches in training


@pytest.mark.parametrize("name", CACHED)
def test_a_recomputing_plan_turns_the_training_cache_off_as_transformers_does(name):
    """The members keep use_cache=True, as from_config gives it: in training under a plan that recomputes, no cache
    is built (the recompute would write it again); without gradients, or in eval mode, it is, as in transformers; the
    config is never changed, and removing the plan removes the switch."""
    _require(BY_NAME[name])
    _, _, batch, chain = _setup(name)
    model = _build(name)
    assert model.config.use_cache is True
    applied = apply_plan(model, "all", chain)
    assert applied.cache_off and applied.to_dict()["cache_off"] == list(applied.cache_off)
    assert model(**batch).past_key_values is None  # training, gradients on
    with torch.no_grad():
        assert model(**batch).past_key_values is not None
    model.eval()
    assert model(**batch).past_key_values is not None
    model.train()
    assert model.config.use_cache is True
    remove_plan(model)
    assert model(**batch).past_key_values is not None
    assert apply_plan(_build(name), "0", chain).cache_off == ()  # a plan that recomputes nothing keeps it


@pytest.mark.parametrize("name", [*CACHED, "bart"])
def test_the_training_cache_changes_no_value_beyond_rounding(name):
    """What the cache changes in a plan-free step is where keys and values lie in memory, not what they are."""
    _require(BY_NAME[name])
    made = [{k: v for k, v in _reference(name, cache_off=off).items() if v is not None} for off in (False, True)]
    difference = compare_steps(*made)  # as check_plans' steps: a frozen parameter's gradient (None) left out
    assert difference.relative < 1e-5, difference




def test_a_lora_adapter_trains_its_own_weights_and_nothing_else_under_every_plan():
    """The frozen base gets no gradient under any plan (none is made for it), every adapter weight gets one that is
    not zero, and a plan changes no parameter's requires_grad: the comparisons above compare the adapter's
    gradients, not Nones."""
    _require(BY_NAME["llama_lora"])
    _, _, _, chain = _setup("llama_lora")
    trainable = {k for k, p in _build("llama_lora").named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
    assert len(trainable) == 2 * 2 * chain.length  # A and B, on q_proj and v_proj, in every layer
    for plan in _offered(chain.length):
        model = _build("llama_lora")
        apply_plan(model, plan, chain)
        assert {k for k, p in model.named_parameters() if p.requires_grad} == trainable, plan
        got = _train_step("llama_lora", model)
        for key, p in model.named_parameters():
            grad = got[f"grad:{key}"]
            assert (grad is not None) == (key in trainable), (plan, key)
            assert grad is None or grad.abs().max() > 0, (plan, key)
        remove_plan(model)


def test_gemma2_layers_get_different_masks():
    needs("transformers")
    model = _build("gemma2")
    assert set(model.config.layer_types[:2]) == {"sliding_attention", "full_attention"}
    workload, _, batch, _ = _setup("gemma2")
    assert model.config.sliding_window < batch["input_ids"].shape[1]
    masks = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: masks.append(k.get("attention_mask")), with_kwargs=True)
             for layer in model.model.layers]
    with torch.no_grad():
        workload.loss(model, batch)
    for hook in hooks:
        hook.remove()
    assert isinstance(masks[0], torch.Tensor) and isinstance(masks[1], torch.Tensor)
    assert not torch.equal(masks[0], masks[1])  # sliding window and full attention
    assert torch.equal(masks[0], masks[2]) and torch.equal(masks[1], masks[3])


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_loss_holds_the_router_loss(name):
    needs("transformers")
    model = _build(name)
    _, _, batch, _ = _setup(name)
    out = model(**batch)
    assert out.router_logits is not None and out.aux_loss is not None and float(out.aux_loss.detach()) > 0
    assert not torch.equal(out.loss, model(**batch, output_router_logits=False).loss)


def test_accelerate_hook_and_forward_hook_stay_exact_and_the_hook_comes_back():
    _require(BY_NAME["qwen2_hooked"])
    from accelerate.hooks import remove_hook_from_module

    _, _, _, chain = _setup("qwen2_hooked")
    index = chain.blocks.index("model.layers.1")
    reference_model = _build("qwen2_hooked")
    reference = _train_step("qwen2_hooked", reference_model)
    assert len(reference_model.zoo_records) == 1 and reference_model.model.layers[1].zoo_pre_forward_calls == 1

    unhooked = _build("qwen2_hooked")
    remove_hook_from_module(unhooked.model.layers[1])
    assert not torch.equal(_train_step("qwen2_hooked", unhooked)["loss"], reference["loss"])  # the hook does something

    for plan in auto_plans(chain.length):
        model = _build("qwen2_hooked")
        layer = model.model.layers[1]
        before = layer.forward
        assert before is model.zoo_hooked_forward
        applied = apply_plan(model, plan, chain)
        wrapped = index in applied.recomputed
        assert (layer.forward is not before) == wrapped
        got = _train_step("qwen2_hooked", model)
        assert not _differences(reference, got), plan
        assert len(model.zoo_records) == 1, f"{plan}: the forward hook ran {len(model.zoo_records)} times"
        assert torch.equal(model.zoo_records[0], reference_model.zoo_records[0]), plan
        assert layer.zoo_pre_forward_calls == 1 + wrapped  # the accelerate hook is inside forward: the recompute runs it
        remove_plan(model)
        assert layer.forward is before and layer.__dict__["forward"] is before


@pytest.mark.parametrize("plan", ["0+offload", "all+offload"])
@pytest.mark.parametrize("member", MEMBERS)
def test_offloaded_plans_are_bitwise_exact_and_lighter_on_the_device(member, plan, monkeypatch):
    # Activation offload copies what the forward pass saves to the host and back: the step must not change, and the
    # device must hold less than the same plan without offload (the CPU's emulation: host copies outside the meter).
    # The zoo's tensors are tiny: every saved tensor moves here, whatever its size.
    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)
    _require(member)
    _, _, _, chain = _setup(member.name)
    reference = _reference_for(member.name, plan)
    model = _build(member.name)
    apply_plan(model, plan, chain)
    got = _train_step(member.name, model)
    diffs = _differences(reference, got)
    assert not diffs, f"plan {plan} on {member.name} is not bitwise exact:\n  " + "\n  ".join(diffs[:15])
    assert offloader_of(model).moved > 0
    remove_plan(model)
    plain = _build(member.name)
    apply_plan(plain, Plan(plan).base, chain)
    offloaded = _build(member.name)
    apply_plan(offloaded, plan, chain)
    if Plan(plan).base.off:  # everything saved moved: the peak falls
        assert _peak(member.name, offloaded) < _peak(member.name, plain)
    else:  # plan all keeps only the blocks' inputs, a few KiB at these sizes; the peak may sit where none is held
        assert _peak(member.name, offloaded) <= _peak(member.name, plain)



# --- The run-time check ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_lora", "cnn_batchnorm", "per_layer_args"])  # llama: use_cache on, as loaded
def test_check_plans_finds_the_zoo_exact(name):
    member = BY_NAME[name]
    _require(member)
    _, _, _, chain = _setup(name)
    workload = Workload.from_specs(member.build).with_chain(chain)
    plans = _offered(chain.length)
    checks = check_plans(workload, plans, batch_size=member.batch_size, device="cpu")
    assert [c.plan for c in checks] == [p for p in plans if p != "0"]
    assert {c.plan: c.status for c in checks} == {c.plan: "exact" for c in checks}, [c.describe() for c in checks]


class _Shared:
    value = 1.0


class _ReadsShared(nn.Module):
    """Reads a value its model's loop changes between calls: no recompute can replay it."""

    def __init__(self, width: int, shared: _Shared | None, counter: list[int] | None) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.shared, self.counter = shared, counter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            gain = self.shared.value
        else:
            self.counter[0] += 1
            gain = 1 + 0.1 * self.counter[0]
        # Inside the tanh: the tensor tanh saves for its backward pass depends on the state, so a recompute that
        # reads the state later saves a different one (a factor outside would live in the graph, not be recomputed).
        return x + torch.tanh(self.lin(x) * gain)


class LoopState(nn.Module):
    """``state="gain"``: the loop sets a gain all blocks share; ``"counter"``: every call bumps a shared count."""

    def __init__(self, state: str = "gain", width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.shared = _Shared() if state == "gain" else None
        self.counter = None if state == "gain" else [0]
        self.blocks = nn.ModuleList(_ReadsShared(width, self.shared, self.counter) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.counter is not None:
            self.counter[0] = 0
        for i, block in enumerate(self.blocks):
            if self.shared is not None:
                self.shared.value = 1.0 + i
            x = block(x)
        return x.pow(2).mean()

    def example_batch(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 8)


@pytest.mark.parametrize("state", ["gain", "counter"])
def test_check_plans_refuses_a_block_reading_state_its_loop_changes(state):
    workload = Workload.from_specs(LoopState, model_kwargs={"state": state})
    plans = auto_plans(4)
    checks = check_plans(workload, plans, batch_size=2, device="cpu")
    assert [c.plan for c in checks] == [p for p in plans if p != "0"]
    for check in checks:
        assert check.status in ("differs", "failed"), check.describe()
        assert not check.ok


def _steady_peak(workload: Workload, precision: str, batch_size: int, *, prime: bool, steps: int,
                 plan: str = "0") -> tuple[int, list]:
    """The tensor meter's peak over ``steps`` steps of a fresh trainer, its state primed or not; and its losses."""
    from autotune.records import Config
    from autotune.training.trainer import Trainer

    trainer = Trainer(workload, Config(precision, plan, batch_size), torch.device("cpu"))
    with TensorMeter().measure() as h:
        trainer.build(prime=prime)
        torch.manual_seed(FORWARD_SEED)
        batch = workload.make_batch(trainer.model, batch_size)
        for _ in range(steps):
            trainer.step(batch)
    return h.reading.peak_bytes, trainer.losses


BUNDLED = [pytest.param("autotune.examples:TinyGPT", {"n_layer": 2, "block_size": 16, "n_embd": 16, "n_head": 2,
                                                      "vocab_size": 32}, id="TinyGPT"),
           pytest.param("autotune.examples:ResNetish", {"depth": 4, "channels": 8, "image_size": 16}, id="ResNetish")]


# Models that keep something of every step (qwen2_hooked's forward hook records each output): their peak
# grows with the steps metered, whatever the optimizer does.
GROWS_PER_STEP = {"qwen2_hooked"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("member", MEMBERS)
def test_one_step_after_priming_the_optimizer_peaks_as_two_steps_did(member, precision):
    # Trials meter one step, the optimizer's state created before it by a step that changes nothing; they
    # metered two (the state is created in the first). The peaks must be equal, and training the same.
    _require(member)
    workload = Workload.from_specs(member.build)
    two, two_losses = _steady_peak(workload, precision, member.batch_size, prime=False, steps=2)
    one, _ = _steady_peak(workload, precision, member.batch_size, prime=True, steps=1)
    primed_two, primed_losses = _steady_peak(workload, precision, member.batch_size, prime=True, steps=2)
    assert primed_losses == two_losses  # bitwise: priming changes no weight and no moment
    assert primed_two == two  # by the second step the state exists either way
    if member.name in GROWS_PER_STEP:
        assert one < primed_two
    else:
        assert one == two, f"{member.name}: one primed step peaks at {one}, two steps at {two}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spec, kwargs", BUNDLED)
def test_one_primed_step_peaks_as_two_steps_did_on_the_bundled_models(spec, kwargs, precision):
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    assert _steady_peak(workload, precision, 4, prime=True, steps=1)[0] == _steady_peak(workload, precision, 4, prime=False,
                                                                                         steps=2)[0]


def _order_violations(workload: Workload, precision: str, batch_size: int, length: int) -> tuple[list, list]:
    """The pairs of plans known to need no more memory one than the other, and those whose peaks say otherwise."""
    plans = auto_plans(length)
    peaks = {plan: _steady_peak(workload, precision, batch_size, prime=True, steps=1, plan=plan)[0] for plan in plans}
    pairs = [(a, b) for a in plans for b in plans if a != b and Plan(a).needs_no_more_memory_than(b, length)]
    return pairs, [f"{a} {peaks[a]} > {b} {peaks[b]}" for a, b in pairs if peaks[a] > peaks[b]]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spec, kwargs", BUNDLED)
def test_the_plan_order_holds_on_the_bundled_models(spec, kwargs, precision):
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    pairs, wrong = _order_violations(workload, precision, 4, find_chain(workload.build_model()).length)
    assert pairs and not wrong, wrong


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("member", MEMBERS)
def test_plans_known_to_need_no_more_memory_do_not(member, precision):
    # The search takes a plan's out-of-memory at a batch size as the failure of every plan that needs at least
    # as much (Plan.needs_no_more_memory_than): nested recomputed blocks, all below the selective plans, sac-linear
    # and sac-lean below sac-matmul. Every such pair, measured: one primed step, the trial's peak.
    _require(member)
    pairs, wrong = _order_violations(Workload.from_specs(member.build), precision, member.batch_size, member.length)
    assert pairs
    assert not wrong, f"{member.name}: " + "; ".join(wrong)

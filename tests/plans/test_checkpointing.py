import pytest
import torch
from torch import nn

from autotune.vocabulary import Plan, auto_plans
from autotune.plans.checkpointing import apply_plan, find_chain, order_chain, remove_plan
from autotune.errors import AutotuneError, UsageError
from autotune.examples import Block, ResNetish, TinyGPT
from autotune.meters import TensorMeter
from autotune.training.precision import keep_in_fp32


class TupleBlock(nn.Module):
    """Returns (hidden, extra) like a Hugging Face transformer block, and takes a keyword argument."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, hidden, scale=None):
        out = torch.tanh(self.lin(hidden)) * (scale if scale is not None else 1.0)
        return (out, out.mean())


class PerLayer(nn.Module):
    """Each block gets its own scale, and the loop works between blocks: a plan must replay each call as it was."""

    def __init__(self, depth=6, width=16):
        super().__init__()
        self.layers = nn.ModuleList(TupleBlock(width) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.register_buffer("scales", torch.linspace(0.5, 2.0, depth))

    def forward(self, x):
        extras = []
        for i, layer in enumerate(self.layers):
            outputs = layer(x, scale=self.scales[i])
            x = self.norms[i](outputs[0]) * 0.5 + x  # ops between blocks
            extras.append(outputs[1])
        return self.head(x).sum() + torch.stack(extras).square().sum()


class EncoderDecoder(nn.Module):
    """Two containers of blocks; the decoder's are defined first but run second."""

    def __init__(self, width=8):
        super().__init__()
        self.decoder = nn.ModuleList(TupleBlock(width) for _ in range(2))
        self.encoder = nn.ModuleList(TupleBlock(width) for _ in range(3))

    def forward(self, x):
        for block in self.encoder:
            x = block(x)[0]
        for block in self.decoder:
            x = block(x, scale=2.0)[0]
        return x.sum()


class Stateful(nn.Module):
    """A block with batch norm, a counter buffer updated in place and one replaced by a new tensor."""

    def __init__(self, width=8):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        self.calls = self.calls + 1  # as EMA codebooks do: a new tensor, its version counter untouched
        return torch.relu(self.bn(self.lin(x)))


def _run_tuple(m):
    return m(torch.randn(4, 16, generator=torch.Generator().manual_seed(3)))


def _step(model, run):
    torch.manual_seed(1)
    out = run(model)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, \
        {n: b.clone() for n, b in model.named_buffers()}


MODELS = {
    "module_list_dropout": (lambda: TinyGPT(n_layer=6, block_size=16, n_embd=32, n_head=4, vocab_size=64, dropout=0.1),
                            lambda m: m(**m.example_batch(3)).loss),
    "sequential_batchnorm": (lambda: ResNetish(depth=5, channels=8, image_size=8),
                             lambda m: m.loss(m(m.example_batch(3)[0]), m.example_batch(3)[1])),
    "per_layer_arguments": (PerLayer, _run_tuple),
    "stateful_blocks": (lambda: nn.Sequential(Stateful(), Stateful(), Stateful(), nn.Linear(8, 1)),
                        lambda m: m(torch.randn(5, 8, generator=torch.Generator().manual_seed(2))).sum()),
}


@pytest.mark.parametrize("name", MODELS)
def test_every_plan_trains_exactly_the_same_model(name):
    """Loss, every gradient and every buffer after a step: bitwise the same with each plan as without one."""
    factory, run = MODELS[name]
    torch.manual_seed(0)
    reference = factory()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    want = _step(reference, run)
    chain = find_chain(reference)
    plans = auto_plans(chain.length) + ["3", "every2", "1"]
    for plan in dict.fromkeys(plans):
        model = factory()
        model.load_state_dict(state)
        applied = apply_plan(model, plan)
        assert list(model.state_dict()) == list(state)  # the plan adds no parameters or buffers
        loss, grads, buffers = _step(model, run)
        assert torch.equal(loss, want[0]), f"plan {plan}: loss"
        for key, grad in want[1].items():
            assert torch.equal(grads[key], grad), f"plan {plan}: gradient of {key}"
        for key, buffer in want[2].items():
            assert torch.equal(buffers[key], buffer), f"plan {plan}: buffer {key}"
        assert len(applied.recomputed) == len(Plan(plan).blocks(chain.length))


def test_batch_norm_statistics_are_updated_once_per_step():
    model = ResNetish(depth=3, channels=4, image_size=8)
    apply_plan(model, "all")
    images, labels = model.example_batch(2)
    model.loss(model(images), labels).backward()
    tracked = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == 1 for b in tracked)


def test_find_chain():
    gpt = find_chain(TinyGPT(n_layer=5, block_size=16))
    assert gpt.blocks == tuple(f"transformer.h.{i}" for i in range(5))
    assert (gpt.containers, gpt.block_types, gpt.length) == (("transformer.h",), ("Block",), 5)
    res = find_chain(ResNetish(depth=6))  # the stem and head are not blocks
    assert (res.containers, res.block_types, res.length) == (("",), ("ResidualBlock",), 6)
    assert find_chain(nn.Linear(3, 3)) is None
    leaves = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))  # torch.nn layers are not blocks
    assert find_chain(leaves) is None
    keyed = nn.Module()  # torchtitan's models keep their blocks in an nn.ModuleDict keyed by layer number
    keyed.layers = nn.ModuleDict({str(i): TupleBlock(4) for i in range(3)})
    keyed.norms = nn.ModuleDict({"a": nn.LayerNorm(4), "b": nn.LayerNorm(4)})
    chain = find_chain(keyed)
    assert (chain.blocks, chain.containers, chain.block_types) == (
        ("layers.0", "layers.1", "layers.2"), ("layers",), ("TupleBlock",))


def test_blocks_inside_blocks_are_not_blocks_and_every_container_counts():
    model = EncoderDecoder()
    chain = find_chain(model)
    assert chain.containers == ("decoder", "encoder") and chain.length == 5
    ordered = order_chain(model, chain, lambda: model(torch.randn(2, 8)))
    assert ordered.blocks == ("encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1")
    assert ordered.ordered_by == "forward"
    assert [ordered.blocks[i] for i in Plan("2").blocks(ordered.length)] == ["encoder.0", "encoder.1", "encoder.2"]

    class Experts(nn.Module):  # a block holding a list of experts: the layers are the blocks, not the experts
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(TupleBlock(4) for _ in range(4))

    outer = nn.Module()
    outer.layers = nn.ModuleList(Experts() for _ in range(2))
    assert find_chain(outer).blocks == ("layers.0", "layers.1")


def test_remove_plan_restores_every_forward_exactly():
    model = TinyGPT(n_layer=4, block_size=8)
    keep_in_fp32(model, ("LayerNorm",), "cpu")
    model.transformer.h[1].forward = own = model.transformer.h[1].forward  # an instance forward set by someone else
    before = {name: (type(m), vars(m).get("forward")) for name, m in model.named_modules()}
    apply_plan(model, "all")
    # each block took a recomputed class of its own class (dynamo guards a class, not each model's objects); the
    # block with an instance forward of its own got the plan's forward on the instance
    assert [type(b) is Block for b in model.transformer.h] == [False, True, False, False]
    assert "forward" in vars(model.transformer.h[1]) and all(isinstance(b, Block) for b in model.transformer.h)
    remove_plan(model)
    assert {name: (type(m), vars(m).get("forward")) for name, m in model.named_modules()} == before
    assert model.transformer.h[1].forward is own
    model(**model.example_batch(2)).loss.backward()
    with pytest.raises(UsageError, match="already has a checkpoint plan"):
        apply_plan(model, "2")
        apply_plan(model, "2")


def test_a_forward_replaced_after_the_plan_is_not_silently_dropped():
    model = TinyGPT(n_layer=2, block_size=8)
    apply_plan(model, "all")
    block = model.transformer.h[0]
    block.forward = lambda x: x
    with pytest.raises(AutotuneError, match="replaced after the plan"):
        remove_plan(model)


def test_hooks_run_once_and_see_what_they_saw_without_a_plan():
    def run(plan):
        torch.manual_seed(0)
        model = PerLayer(depth=3)
        seen = []
        model.layers[1].register_forward_hook(lambda m, args, out: seen.append(out[0].detach().clone()))
        model.layers[0].register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True)
        apply_plan(model, plan)
        loss, grads, _ = _step(model, _run_tuple)
        return loss, grads, seen

    loss, grads, seen = run("0")
    loss_all, grads_all, seen_all = run("all")
    assert len(seen) == len(seen_all) == 1 and torch.equal(seen[0], seen_all[0])  # not called again by the recompute
    assert torch.equal(loss, loss_all) and all(torch.equal(grads[k], grads_all[k]) for k in grads)


def test_plans_lower_the_peak_and_all_is_lowest():
    def peak(plan):
        torch.manual_seed(0)
        model = TinyGPT(n_layer=8, block_size=64, n_embd=32, n_head=4, vocab_size=64)
        apply_plan(model, plan)
        with TensorMeter().measure() as h:
            h.track(model.parameters())
            model(**model.example_batch(4)).loss.backward()
        return h.reading.peak_bytes

    peaks = {plan: peak(plan) for plan in ("0", "every4", "2", "4", "all")}
    assert peaks["all"] < peaks["4"] < peaks["2"] < peaks["every4"] < peaks["0"]
    assert peaks["all"] < 0.5 * peaks["0"]


def test_bad_plans_are_refused():
    with pytest.raises(UsageError, match="at most 4"):
        apply_plan(TinyGPT(n_layer=4, block_size=8), "5")
    with pytest.raises(UsageError, match="at most 4"):
        apply_plan(TinyGPT(n_layer=4, block_size=8), "every5")
    with pytest.raises(UsageError, match="no repeated blocks"):
        apply_plan(nn.Linear(2, 2), "2")
    with pytest.raises(UsageError, match="unknown checkpoint plan"):
        apply_plan(TinyGPT(n_layer=4, block_size=8), "half")
    assert apply_plan(nn.Linear(2, 2), "0").recomputed == ()


def test_plans_run_without_grad_and_in_eval():
    model = TinyGPT(n_layer=4, block_size=8)
    apply_plan(model, "all")
    with torch.no_grad():
        assert model(**model.example_batch(2)).loss.isfinite()
    model.eval()
    model(**model.example_batch(2)).loss.backward()

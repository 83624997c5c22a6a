import pytest
import torch
from torch import nn

from autotune.checkpointing import apply_plan, auto_segment_counts, find_chain, remove_plan
from autotune.errors import AutotuneError, UsageError
from autotune.examples import ResNetish, TinyGPT
from autotune.meters import TensorMeter


class TupleBlock(nn.Module):
    """Returns (hidden, extra) like a Hugging Face transformer block, and takes a keyword argument."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, hidden, scale=None):
        out = torch.tanh(self.lin(hidden)) * (scale if scale is not None else 1.0)
        return (out, out.mean())


class TupleStack(nn.Module):
    def __init__(self, depth=6, width=16):
        super().__init__()
        self.layers = nn.ModuleList(TupleBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        extras = []
        for layer in self.layers:
            outputs = layer(x, scale=2.0)
            x = outputs[0]
            extras.append(outputs[1])
        return self.head(x).sum() + 0 * sum(extras)


class Shuffler(nn.Module):
    """Changes the hidden state between blocks: blocks cannot be grouped."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * 0.5
        return x.sum()


def test_find_chain():
    gpt = find_chain(TinyGPT(n_layer=5, block_size=16))
    assert (gpt.path, gpt.kind, gpt.length, gpt.block_type) == ("transformer.h", "module_list", 5, "Block")
    res = find_chain(ResNetish(depth=6))
    assert (res.path, res.kind, res.length, res.block_type) == ("", "sequential", 8, "ResidualBlock")
    assert find_chain(nn.Linear(3, 3)) is None
    mixed = nn.Module()
    mixed.parts = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)])
    assert find_chain(mixed) is None


def test_auto_segment_counts():
    assert auto_segment_counts(12) == [0, 2, 3, 4, 8, 12]
    assert auto_segment_counts(8) == [0, 2, 3, 4, 8]
    assert auto_segment_counts(2) == [0, 2]
    assert auto_segment_counts(1) == [0]


def _forward_and_grads(model, run):
    torch.manual_seed(1)
    out = run(model)
    out.backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "factory, run, segments",
    [
        (lambda: TinyGPT(n_layer=6, block_size=16, n_embd=32, n_head=4, vocab_size=64, dropout=0.1),
         lambda m: m(**m.example_batch(3)).loss, [2, 3, 6]),
        (lambda: ResNetish(depth=5, channels=8, image_size=8),
         lambda m: m.loss(m(m.example_batch(3)[0]), m.example_batch(3)[1]), [2, 3, 7]),
        (TupleStack, lambda m: m(torch.randn(4, 16, generator=torch.Generator().manual_seed(3))), [2, 3, 6]),
    ],
    ids=["module_list", "sequential", "tuple_blocks"],
)
def test_plans_keep_forward_and_gradients(factory, run, segments):
    torch.manual_seed(0)
    reference = factory()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    want_out, want_grads = _forward_and_grads(reference, run)
    for s in segments:
        model = factory()
        model.load_state_dict(state)
        plan = apply_plan(model, s)
        assert plan.segments == s and len(plan.checkpointed) == s - 1
        assert list(model.state_dict()) == list(state)  # the plan adds no parameters or buffers
        out, grads = _forward_and_grads(model, run)
        torch.testing.assert_close(out, want_out)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, msg=f"segments={s}: gradient of {name}")


def _peak(model, run):
    with TensorMeter().measure() as h:
        h.track(model.parameters())
        run(model).backward()
    return h.reading.peak_bytes


@pytest.mark.parametrize("factory, run", [
    (lambda: TinyGPT(n_layer=8, block_size=64, n_embd=32, n_head=4, vocab_size=64), lambda m: m(**m.example_batch(4)).loss),
    (lambda: ResNetish(depth=8, channels=16, image_size=16), lambda m: m.loss(m(m.example_batch(4)[0]), m.example_batch(4)[1])),
], ids=["module_list", "sequential"])
def test_segments_lower_the_peak(factory, run):
    torch.manual_seed(0)
    peaks = {}
    for s in (0, 3):
        model = factory()
        apply_plan(model, s)
        peaks[s] = _peak(model, run)
    assert peaks[3] < 0.8 * peaks[0]


def test_bad_plans_are_refused():
    with pytest.raises(UsageError, match="at most 4"):
        apply_plan(TinyGPT(n_layer=4, block_size=8), 5)
    with pytest.raises(UsageError, match="no chain"):
        apply_plan(nn.Linear(2, 2), 2)
    assert apply_plan(nn.Linear(2, 2), 0).segments == 0


def test_grouping_refuses_a_model_that_changes_state_between_blocks():
    model = Shuffler()
    apply_plan(model, 2)
    with pytest.raises(AutotuneError, match="cannot be grouped"):
        model(torch.randn(2, 8)).backward()


def test_remove_plan_restores_the_model():
    model = TinyGPT(n_layer=4, block_size=8)
    apply_plan(model, 2)
    assert "forward" in vars(model.transformer.h[0])
    remove_plan(model)
    assert not any("forward" in vars(m) for m in model.modules())
    model(**model.example_batch(2)).loss.backward()


def test_plans_run_without_grad():
    model = TinyGPT(n_layer=4, block_size=8)
    apply_plan(model, 2)
    with torch.no_grad():
        assert model(**model.example_batch(2)).loss.isfinite()

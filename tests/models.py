"""Small models for the tests, importable as ``tests.models:NAME`` from the CLI."""

import torch
from torch import nn


class ExplodingForward(nn.Module):
    """Fails in forward on its third call: trials record it as failed, the search goes on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls >= 3:
            raise ValueError("boom in forward")
        return self.lin(x).sum()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


class RaisesInInit(nn.Module):
    def __init__(self):
        super().__init__()
        raise RuntimeError("cannot build me")


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)

    def example_batch(self, batch_size):
        return (torch.randn(batch_size, 4), torch.randint(2, (batch_size,)))


class DictLoss(nn.Module):
    """Returns {"loss": ...} from a dict batch with labels, as many libraries do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, inputs, labels):
        return {"loss": nn.functional.cross_entropy(self.lin(inputs), labels)}


class NoChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 16)


def pair_dataset():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g), torch.randint(2, (40,), generator=g))


class _DictData(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"inputs": torch.full((4,), float(i)), "labels": torch.tensor(i % 2)}


def dict_dataset():
    return _DictData()


def not_a_model():
    return 42


NOT_CALLABLE = 3


class SelfKill(nn.Module):
    """Kills its own process with SIGKILL at batch size 4: a segfault, as far as the search can tell."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 4:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


LEAKED = []  # what Leaky keeps between trials, as a model that caches its activations in a global would


class Leaky(nn.Module):
    """Keeps 4 MiB of every forward pass in a module-level list: a process that runs it ends up holding more."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        LEAKED.append(torch.zeros(1 << 20))
        return self.lin(x).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


class LeaksAtFour(Leaky):
    """Leaks only at batch size 4: a worker clean after its first trial, not after a later one."""

    def forward(self, x):
        if x.shape[0] == 4:
            LEAKED.append(torch.zeros(1 << 20))
        return self.lin(x).square().mean()


class Hangs(nn.Module):
    """Sleeps in forward at batch size 2, where no operator runs to notice the time limit."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 2 and self.training and torch.is_grad_enabled():
            import time

            time.sleep(3600)
        return self.lin(x).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


class ForwardRaises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("shapes do not match in my layer")

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


class _Triples(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return (torch.zeros(4), torch.tensor(0), torch.tensor(1))


def triple_dataset():
    return _Triples()


def tiny_dataset():
    return torch.utils.data.TensorDataset(torch.randn(3, 4), torch.randint(2, (3,)))


# Data for the tiny TinyGPT of the tests (block_size 64, vocabulary 64).
def tiny_tokens():
    from autotune.examples import token_dataset

    return token_dataset(size=320, block_size=64, vocab_size=64)


def tiny_variable_loader():
    from autotune.examples import variable_token_loader

    return variable_token_loader(size=640, block_size=64, vocab_size=64)


class NanAfterThreeSteps(nn.Module):
    """Trains normally for three steps, then its loss is NaN: what a diverging run looks like."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, inputs, labels):
        self.calls += 1
        loss = nn.functional.cross_entropy(self.lin(inputs).float(), labels)
        return {"loss": loss * float("nan") if self.calls > 3 else loss}


class Fp16Overflow(nn.Module):
    """Gradients of its fp16 activations exceed 65504 even unscaled: the GradScaler can only skip."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inputs, labels):
        hidden = self.lin(inputs)  # fp16 under autocast
        return {"loss": hidden.float().sum() * 1e5 + 0 * labels.sum()}  # d loss / d hidden = 1e5 > 65504


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"inputs": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)}


def pairs():
    return _Pairs()


class _ReadsLoopState(nn.Module):
    def __init__(self, state):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.state = state  # shared with the model and every other block

    def forward(self, x):
        return torch.tanh(self.lin(x) * (1 + self.state["layer"]))  # tanh saves its output: the recompute changes it


class LoopState(nn.Module):
    """Its loop tells each block which layer it is through state they share: a recompute in the backward
    pass reads the value the loop left last, so no checkpoint plan can train this model exactly."""

    def __init__(self):
        super().__init__()
        self.state = {"layer": 0}
        self.blocks = nn.ModuleList(_ReadsLoopState(self.state) for _ in range(4))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            self.state["layer"] = i
            x = block(x)
        return x.square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(batch_size))


class _Images(torch.utils.data.Dataset):
    """Images whose height and width vary independently: the tallest and the widest are different items."""

    def __init__(self):
        self.sizes = [(8, 8)] * 20 + [(24, 8), (8, 20)]

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        h, w = self.sizes[i]
        return torch.zeros(3, h, w), torch.tensor(i % 2)


def varied_images():
    return _Images()


def pad_images(items):
    h = max(x.shape[1] for x, _ in items)
    w = max(x.shape[2] for x, _ in items)
    images = torch.zeros(len(items), 3, h, w)
    for k, (x, _) in enumerate(items):
        images[k, :, : x.shape[1], : x.shape[2]] = x
    return images, torch.stack([y for _, y in items])


class _WithLengths(torch.utils.data.Dataset):
    def __init__(self):
        self.lengths = [3, 9, 4, 7]

    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise AssertionError("the lengths attribute says the sizes: no item is read")


def bucketed_loader():
    """A loader with its own batch sampler (length buckets, as many text pipelines use)."""
    from autotune.examples import variable_token_loader

    loader = variable_token_loader(size=320, block_size=64, vocab_size=64)
    lengths = [len(loader.dataset[i]["idx"]) for i in range(len(loader.dataset))]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    buckets = [order[i:i + 8] for i in range(0, len(order), 8)]
    return torch.utils.data.DataLoader(loader.dataset, batch_sampler=buckets, collate_fn=loader.collate_fn)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"idx": torch.zeros(4, dtype=torch.long), "targets": torch.zeros(4, dtype=torch.long)}


def stream():
    return _Stream()


class DiesInTheProbe(nn.Module):
    """Trains normally for a dozen steps, then kills its process: a crash only a long run (the probe) meets."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 12 and torch.is_grad_enabled():
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return self.lin(x).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


def vectors():
    return [torch.randn(4) for _ in range(64)]


class DeviceAssert(nn.Module):
    """Indexes past its embedding at batch size 4: on CUDA a device-side assert, which poisons the context."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, idx):
        if idx.shape[0] == 4:
            idx = idx + 100  # out of range: an illegal access on the GPU, an IndexError on the CPU
        return self.emb(idx).square().mean()

    def example_batch(self, batch_size):
        return torch.randint(8, (batch_size, 3))


class TwoHeads(nn.Module):
    """A model whose loss is computed outside it (--step): a main output and an auxiliary one."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
        self.main, self.aux = nn.Linear(width, 4), nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.main(x), self.aux(x)

    def example_batch(self, batch_size):
        g = torch.Generator().manual_seed(batch_size)
        return torch.randn(batch_size, 16, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def two_heads_step(model, batch):
    """The loss as a training loop computes it: cross-entropy on the main head, a penalty on the auxiliary one."""
    x, y = batch
    main, aux = model(x)
    return nn.functional.cross_entropy(main, y) + 0.1 * aux.pow(2).mean()


def step_without_loss(model, batch):
    model(batch[0])  # forgets to return the loss


def two_heads_data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(160, 16, generator=g), torch.randint(0, 4, (160,), generator=g))


# --- torch.compile -----------------------------------------------------------------------------------------------
# Two custom operators whose fake (meta) implementations stand for what dynamo meets in a model that will not compile:
# one raises, one never returns. Eager code runs their real implementation and never calls the fake one.


@torch.library.custom_op("autotune_tests::not_traceable", mutates_args=())
def _not_traceable(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_not_traceable.register_fake
def _(x):
    raise RuntimeError("this operator has no shape function that dynamo can trace")


_not_traceable.register_autograd(lambda ctx, grad: grad * 2)


@torch.library.custom_op("autotune_tests::slow_to_trace", mutates_args=())
def _slow_to_trace(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_slow_to_trace.register_fake
def _(x):
    import time

    time.sleep(3600)  # tracing it (compiling) hangs; running it does not
    return torch.empty_like(x)


_slow_to_trace.register_autograd(lambda ctx, grad: grad * 2)


class _ThroughOneOp(nn.Module):
    """A linear layer, then ``op``, a custom operator that eager code runs and dynamo traces its own way."""

    op = staticmethod(lambda x: x)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.op(self.lin(x)).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 4)


class DoesNotCompile(_ThroughOneOp):
    """Trains eager; under torch.compile, dynamo fails while tracing its operator."""

    op = staticmethod(_not_traceable)


class CompileHangs(_ThroughOneOp):
    """Trains eager; its compile never ends (dynamo tracing its operator sleeps)."""

    op = staticmethod(_slow_to_trace)


class _NormedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(torch.relu(self.norm(self.lin(x))))


class BatchNormDropout(nn.Module):
    """Two residual blocks with BatchNorm (running statistics: buffers a recompute must not move twice) and dropout
    (random masks a recompute must draw again alike): small enough to compile in seconds."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_NormedBlock(width), _NormedBlock(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).square().mean()

    def example_batch(self, batch_size):
        return torch.randn(batch_size, 8)


class FrozenWide(nn.Module):
    """A wide frozen linear layer and a small trained head: its weights, not its steps, hold most of its memory (an
    adapter's shape: what a bf16-true prediction's build would count twice)."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.body.requires_grad_(False)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).square().mean()

    def example_batch(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, self.body.in_features)

"""Tune the Lightning Trainer and module you have, then fit: runs offline on a CPU in about a minute.

    python docs/examples/tune_lightning_trainer.py

A small token model whose training_step adds an auxiliary loss, trained with SGD; a datamodule of
variable-length sequences whose batch size is a hyperparameter (where Lightning's own batch-size
finder writes it too); a global batch of 16 (8 a batch x 2 accumulated).
"""

import lightning.pytorch as L
import torch
from torch import nn

from autotune.integrations.lightning import tune_trainer

MAX_LENGTH = 96
BUDGET = "12MiB"  # batch 8 in fp32 needs about 13 MB here: more than the budget less its 10% headroom


def sequences(n: int = 64, vocab: int = 256, seed: int = 0) -> list[dict]:
    """Token sequences with a long tail: most of 8-23 tokens, one in eight the full length."""
    g = torch.Generator().manual_seed(seed)
    lengths = [MAX_LENGTH if i % 8 == 5 else int(torch.randint(8, 24, (1,), generator=g)) for i in range(n)]
    return [{"input_ids": torch.randint(1, vocab, (k,), generator=g)} for k in lengths]


def pad(items: list[dict]) -> dict:
    """Pad a batch to its longest sequence; the padding is left out of the loss (label -100)."""
    ids = nn.utils.rnn.pad_sequence([item["input_ids"] for item in items], batch_first=True)
    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    padding = torch.arange(ids.shape[1])[None, :] >= lengths[:, None]
    return {"input_ids": ids, "labels": ids.masked_fill(padding, -100)}


class Block(nn.Module):
    """A residual feed-forward block: the repeated unit autotune's checkpoint plans count in."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Tagger(L.LightningModule):
    """Predicts each token's successor; an auxiliary head's penalty is added to the loss in training_step."""

    def __init__(self, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head, self.aux = nn.Linear(width, 256), nn.Linear(width, 1)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x), self.aux(x)

    def training_step(self, batch, batch_idx):
        logits, aux = self(batch["input_ids"])
        main = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                           ignore_index=-100)
        return main + 0.01 * aux.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Sequences(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage=None):
        self.data = sequences()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=self.hparams.batch_size, collate_fn=pad, shuffle=True)


def make(accumulate: int = 2) -> tuple[L.Trainer, Tagger, Sequences]:
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return trainer, Tagger(), Sequences()


if __name__ == "__main__":
    trainer, model, data = make()
    report = tune_trainer(trainer, model, datamodule=data, budget=BUDGET, precisions="fp32", segments="0,all")
    print(report.table())
    trainer.fit(model, datamodule=data)  # the recommendation: its batch size, accumulation and checkpointing

"""Tune the Hugging Face Trainer you have, then train it: runs offline on a CPU in about a minute.

    python docs/examples/tune_hf_trainer.py

A tiny GPT-2 built from a config (random weights, nothing downloaded), variable-length examples
padded by a collator, Adafactor, a global batch of 16 (8 a device x 2 accumulation steps).
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from autotune.integrations.transformers import tune_trainer

MAX_LENGTH = 96
BUDGET = "48MiB"  # batch 8 in fp32 needs about 44 MB here: more than the budget less its 10% headroom


def examples(n: int = 64, vocab: int = 256, seed: int = 0) -> list[dict]:
    """Token sequences with a long tail: most of 8-23 tokens, one in eight the full length."""
    g = torch.Generator().manual_seed(seed)
    lengths = [MAX_LENGTH if i % 8 == 5 else int(torch.randint(8, 24, (1,), generator=g)) for i in range(n)]
    return [{"input_ids": torch.randint(1, vocab, (k,), generator=g).tolist()} for k in lengths]


def pad(items: list[dict]) -> dict:
    """Pad a batch to its longest example; padding is masked out of attention and of the loss."""
    n = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for k, item in enumerate(items):
        ids[k, :len(item["input_ids"])] = torch.tensor(item["input_ids"])
        mask[k, :len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_trainer(output_dir: str = "results/hf-example") -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=MAX_LENGTH, vocab_size=256))
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             optim="adafactor", max_grad_norm=1.0, num_train_epochs=1, use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no")
    return Trainer(model=model, args=args, train_dataset=examples(), data_collator=pad)


if __name__ == "__main__":
    trainer = make_trainer()
    report = tune_trainer(trainer, budget=BUDGET, precisions="fp32,bf16", segments="0,all")
    print(report.table())
    trainer.train()  # the recommendation: its batch size, accumulation steps, precision and checkpointing

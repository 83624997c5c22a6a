"""Tune the trainer you already have: one call on a Hugging Face or Lightning trainer, the answer written back.

    from autotune.integrations.transformers import tune_trainer   # a transformers.Trainer
    report = tune_trainer(trainer, budget="24GiB")
    trainer.train()                                                # trains the recommendation

    from autotune.integrations.lightning import tune_trainer      # a lightning Trainer
    report = tune_trainer(trainer, model, datamodule=dm, budget="24GiB")
    trainer.fit(model, datamodule=dm)

Both train what the trainer would train: the model's current weights (every trial starts from an
exact copy of them, so fine-tuning from pretrained weights is tuned as it runs), its training data
through its collator, the optimizer it would make and its own loss (``compute_loss``,
``training_step``). Both keep the user's global batch: the micro batches tried divide it, and
gradient accumulation makes up the rest. Neither module is imported by ``import autotune``; each
imports its framework. What they share lives in :mod:`autotune.integrations.common`.
"""

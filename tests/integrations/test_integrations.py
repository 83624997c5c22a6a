"""Tune the trainer you have: a Hugging Face Trainer and a Lightning Trainer, tuned, written back, trained within budget.

The training after tuning is metered by PyTorch's profiler (the memory timeline of its allocator events), not
by autotune's tensor meter: the check does not share the code it checks.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from autotune.errors import NothingFits, UsageError
from autotune.units import parse_size

from tests.optional import needs
from tests.paths import ROOT

EXAMPLES = os.path.join(ROOT, "docs", "examples")


def example(name: str, framework: str):
    """A script of docs/examples (the docs show it as it is), imported: the tests train what the page shows."""
    needs(framework)
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peak_while(run, tmp_path) -> int:
    """Bytes held at most while ``run()`` trains, on top of what was held before (the model's weights): PyTorch's
    memory timeline of the CPU allocator's events, from its profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run()
    with warnings.catch_warnings():  # deprecated for CUDA's memory snapshots; on the CPU it is the profiler's own
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())
    return max(sum(s) for s in sizes)


def weights(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


# -- Hugging Face ---------------------------------------------------------------------------------------------------


def hf_trainer(tmp_path):
    """The docs' Hugging Face example's trainer, and its budget."""
    hf = example("tune_hf_trainer", "transformers")
    return hf.make_trainer(str(tmp_path / "hf")), hf.BUDGET


def test_a_hugging_face_trainer_is_tuned_and_then_trains_the_recommendation_within_the_budget(tmp_path, caplog):
    from autotune.integrations.transformers import tune_trainer

    trainer, BUDGET = hf_trainer(tmp_path)
    args = trainer.args
    report = tune_trainer(trainer, budget=BUDGET, precisions="fp32,bf16", segments="0,all", measure_steps=2,
                          storage=f"sqlite:///{tmp_path}/s.db", compare_library=False)
    best = report.recommendation
    # The trials trained what the trainer trains: its optimizer (transformers' Adafactor), its loss, its data
    assert report.workload["optimizer"]["name"].startswith("transformers.optimization:Adafactor(")
    optimizer = report.workload["optimizer"]  # the one the trainer's arguments made: its class, settings and source
    assert optimizer["class"] == "transformers.optimization.Adafactor" and optimizer["optim"] == "adafactor"
    assert optimizer["source"] == "TrainingArguments" and optimizer["settings"]["lr"] == args.learning_rate
    assert report.workload["step"].endswith("Trainer.compute_loss") and report.data is not None
    assert report.guard.clip_grad_norm == 1.0
    # The trainer's arguments hold the recommendation, and the user's global batch of 16
    assert (args.per_device_train_batch_size, args.bf16) == (best.batch_size, best.precision == "bf16")
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
    assert trainer._train_batch_size == best.batch_size
    said = [r.getMessage() for r in caplog.records if "the trainer now trains" in r.getMessage()]
    assert len(said) == 1 and said[0] == report.notices[-1]  # logged once, and kept in the report
    # One epoch of the trainer's own training stays within the budget
    held = weights(trainer.model)
    peak = peak_while(trainer.train, tmp_path)
    print(f"recommendation {best.config} {best.peak_bytes} B; trainer.train() {held} + {peak} B; budget {BUDGET}")
    assert held + peak <= parse_size(BUDGET)
    assert trainer.state.global_step == 64 // 16  # 64 examples, a global batch of 16


def test_a_trainer_of_a_peft_model_is_tuned_and_trains_only_the_adapter(tmp_path):
    """The docs' trainer with its GPT-2 under a LoRA adapter (PEFT): tuned as it is (the trainer's optimizer over the
    adapter, the state counted its alone), written back, and its own training changes the adapter and nothing else."""
    from autotune.integrations.transformers import tune_trainer

    hf = example("tune_hf_trainer", "transformers")
    peft = needs("peft")
    from transformers import Trainer

    base = hf.make_trainer(str(tmp_path / "hf"))
    model = peft.get_peft_model(base.model, peft.LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                                            task_type="CAUSAL_LM"))
    trainer = Trainer(model=model, args=base.args, train_dataset=base.train_dataset, data_collator=base.data_collator)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    report = tune_trainer(trainer, budget="24MiB", precisions="fp32", segments="0,all", measure_steps=1, probe=False,
                          storage=f"sqlite:///{tmp_path}/s.db", compare_library=False)
    workload = report.workload
    assert workload["chain"]["containers"] == ["base_model.model.transformer.h"]
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert workload["trainable_parameter_count"] == count < workload["parameter_count"]
    assert 0 < workload["optimizer"]["state_bytes"] < 3 * 4 * count  # Adafactor's factored state, of the adapter
    assert trainer.args.per_device_train_batch_size == report.recommendation.batch_size
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable


def test_a_trainer_that_cannot_fit_is_left_as_it_was(tmp_path):
    from autotune.integrations.transformers import tune_trainer

    trainer, BUDGET = hf_trainer(tmp_path)
    with pytest.raises(NothingFits, match="nothing fits.*the trainer is unchanged"):
        tune_trainer(trainer, budget="3MiB", precisions="fp32", segments="0", measure_steps=2, probe=False,
                     storage=f"sqlite:///{tmp_path}/s.db", compare_library=False)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 2)


def test_a_trainer_without_a_train_dataset_or_with_an_unsized_one_is_one_clear_line(tmp_path):
    from autotune.integrations.transformers import tune_trainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2, 3]}

    trainer, BUDGET = hf_trainer(tmp_path)
    trainer.train_dataset = None
    with pytest.raises(UsageError, match="the trainer has no train_dataset"):
        tune_trainer(trainer, budget=BUDGET)
    trainer.train_dataset = Stream()
    with pytest.raises(UsageError, match="train_dataset is a Stream without a length: autotune needs a map-style"):
        tune_trainer(trainer, budget=BUDGET)
    assert trainer.args.per_device_train_batch_size == 8  # nothing changed


def test_a_trainer_cannot_be_tuned_for_a_precision_its_arguments_cannot_say(tmp_path):
    from autotune.integrations.transformers import tune_trainer

    trainer, BUDGET = hf_trainer(tmp_path)
    with pytest.raises(UsageError, match="cannot write precision bf16-fsdp back: TrainingArguments has no setting for "
                                         "FSDP2's MixedPrecisionPolicy"):
        tune_trainer(trainer, budget=BUDGET, precisions="bf16, BF16-FSDP")
    with pytest.raises(UsageError, match="cannot write precision bf16-true back: TrainingArguments has no setting that "
                                         r"casts the model .*from_pretrained\(..., dtype=torch.bfloat16\)"):
        tune_trainer(trainer, budget=BUDGET, precisions=["bf16-true"])
    assert (trainer.args.per_device_train_batch_size, trainer.args.bf16) == (8, False)  # before any trial
    assert next(trainer.model.parameters()).dtype == torch.float32


def test_the_report_names_the_optimizer_the_training_arguments_make_with_its_weight_decay_groups(tmp_path):
    from autotune.integrations.transformers import tune_trainer

    trainer, _ = hf_trainer(tmp_path)
    trainer.args.optim, trainer.args.optim_args = "sgd", "momentum=0.9"
    trainer.args.learning_rate, trainer.args.weight_decay = 0.1, 0.01
    report = tune_trainer(trainer, budget="1GiB", precisions="fp32", segments="0", batch_sizes="8", measure_steps=2,
                          probe=False, storage=f"sqlite:///{tmp_path}/s.db", compare_library=False)
    optimizer = json.loads(report.to_json())["workload"]["optimizer"]
    assert (optimizer["class"], optimizer["optim"]) == ("torch.optim.SGD", "sgd")
    assert optimizer["source"] == "TrainingArguments"
    assert (optimizer["settings"]["lr"], optimizer["settings"]["momentum"]) == (0.1, 0.9)
    # The trainer's two groups: its weight decay on the weights, none on biases and norms
    decays = [group.get("weight_decay", optimizer["settings"]["weight_decay"]) for group in optimizer["groups"]]
    assert decays == [0.01, 0.0] and all(group["parameters"] > 0 for group in optimizer["groups"])
    assert sum(group["parameters"] for group in optimizer["groups"]) == report.workload["parameter_count"]


def test_a_hugging_face_trainer_evaluates_its_eval_dataset_at_the_largest_batch_within_the_budget(tmp_path):
    """The evaluation batch is sized on eval_dataset (its worst batch, padded by the trainer's collator) with the
    training state resident, written to per_device_eval_batch_size, and the trainer's training with an evaluation
    after every step (at that batch) stays within the budget."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from autotune.integrations.transformers import tune_trainer

    hf = example("tune_hf_trainer", "transformers")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=64, n_head=4, n_positions=hf.MAX_LENGTH, vocab_size=256))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, optim="adafactor", num_train_epochs=1, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", eval_strategy="steps",
                             eval_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=hf.examples(), eval_dataset=hf.examples(256, seed=1),
                      data_collator=hf.pad)
    report = tune_trainer(trainer, budget=hf.BUDGET, precisions="fp32", segments="0", measure_steps=2, probe=False,
                          storage=f"sqlite:///{tmp_path}/s.db", compare_library=False)
    row = report.eval_limit("fp32", "0")
    assert report.search["eval_limits"]["data"] == "--eval-data" and row["source"] == "measured"
    assert not row["during_training"]["at_top"]  # a limit, below the 256 items
    assert args.per_device_eval_batch_size == row["during_training_max_batch_size"] > 16
    assert f"per_device_eval_batch_size 8 -> {args.per_device_eval_batch_size}" in report.notices[-1]
    held = weights(trainer.model)
    peak = peak_while(trainer.train, tmp_path)
    print(f"evaluation batch {args.per_device_eval_batch_size}; trainer.train() {held} + {peak} B; budget {hf.BUDGET}")
    assert held + peak <= parse_size(hf.BUDGET)


# -- Lightning ------------------------------------------------------------------------------------------------------


def lightning_objects():
    """The docs' Lightning example's trainer, module and datamodule, and its budget."""
    lightning = example("tune_lightning_trainer", "lightning")
    return (*lightning.make(), lightning.BUDGET)


def test_a_lightning_trainer_is_tuned_and_then_fits_the_recommendation_within_the_budget(tmp_path, caplog):
    from autotune.integrations.lightning import tune_trainer

    trainer, model, data, BUDGET = lightning_objects()
    report = tune_trainer(trainer, model, datamodule=data, budget=BUDGET, precisions="fp32", segments="0,all",
                          measure_steps=2, storage=f"sqlite:///{tmp_path}/s.db")
    best = report.recommendation
    assert report.workload["optimizer"]["name"].endswith("Tagger.configure_optimizers")
    optimizer = report.workload["optimizer"]  # the one configure_optimizers() built: SGD(lr=0.05, momentum=0.9)
    assert (optimizer["class"], optimizer["source"]) == ("torch.optim.SGD", "configure_optimizers")
    assert (optimizer["settings"]["lr"], optimizer["settings"]["momentum"]) == (0.05, 0.9) and "groups" not in optimizer
    assert report.workload["optimizer"]["state_bytes"] == report.workload["parameter_bytes"]  # SGD: one buffer each
    assert report.workload["step"].endswith("Tagger.training_step")
    assert data.hparams.batch_size == best.batch_size and best.batch_size * trainer.accumulate_grad_batches == 16
    said = [r.getMessage() for r in caplog.records if "the module now trains" in r.getMessage()]
    assert len(said) == 1 and said[0] == report.notices[-1]
    held = weights(model)
    peak = peak_while(lambda: trainer.fit(model, datamodule=data), tmp_path)
    print(f"recommendation {best.config} {best.peak_bytes} B; trainer.fit() {held} + {peak} B; budget {BUDGET}")
    assert held + peak <= parse_size(BUDGET)
    assert trainer.global_step == 64 // 16


def test_a_lightning_module_gets_its_validation_batch_and_validates_within_the_budget(tmp_path):
    """The validation loader's data sizes the evaluation batch, which is written where the datamodule keeps it
    (hparams.val_batch_size); fit with validation at that batch stays within the budget."""
    from autotune.integrations.lightning import tune_trainer

    lightning = example("tune_lightning_trainer", "lightning")

    class Validated(lightning.Tagger):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    class WithValidation(lightning.Sequences):
        def __init__(self) -> None:
            super().__init__()
            self.hparams.val_batch_size = 8

        def setup(self, stage=None):
            super().setup(stage)
            self.validation = lightning.sequences(n=256, seed=1)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(self.validation, batch_size=self.hparams.val_batch_size,
                                               collate_fn=lightning.pad)

    trainer, _, _ = lightning.make()
    model, data = Validated(), WithValidation()
    report = tune_trainer(trainer, model, datamodule=data, budget=lightning.BUDGET, precisions="fp32", segments="0",
                          measure_steps=2, probe=False, storage=f"sqlite:///{tmp_path}/s.db")
    row = report.eval_limit("fp32", "0")
    assert report.search["eval_limits"]["data"] == "--eval-data" and not row["during_training"]["at_top"]
    assert data.hparams.val_batch_size == row["during_training_max_batch_size"] > data.hparams.batch_size
    assert f"hparams.val_batch_size 8 -> {data.hparams.val_batch_size}" in report.notices[-1]
    held = weights(model)
    peak = peak_while(lambda: trainer.fit(model, datamodule=data), tmp_path)
    print(f"validation batch {data.hparams.val_batch_size}; trainer.fit() {held} + {peak} B; budget {lightning.BUDGET}")
    assert held + peak <= parse_size(lightning.BUDGET)


def test_a_configure_optimizers_that_sizes_a_one_cycle_schedule_from_its_trainer_tunes(tmp_path):
    from autotune.integrations.lightning import tune_trainer

    lightning = example("tune_lightning_trainer", "lightning")
    seen = []

    class Scheduled(lightning.Tagger):
        def configure_optimizers(self):  # as Lightning's docs write it: the schedule's length from the trainer
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            seen.append((self.trainer.estimated_stepping_batches, self.trainer.max_epochs,
                         self.trainer.accumulate_grad_batches, self.trainer.lightning_module is self))
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05,
                                                            total_steps=self.trainer.estimated_stepping_batches)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    trainer, _, data = lightning.make()
    trainer.fit_loop.max_epochs = None  # unset, as fit reads it: 1000 epochs
    model = Scheduled()
    report = tune_trainer(trainer, model, datamodule=data, budget=lightning.BUDGET, precisions="fp32", segments="0",
                          measure_steps=2, probe=False, storage=f"sqlite:///{tmp_path}/s.db")
    # 64 sequences, 8 a batch, 2 accumulated: 4 steps an epoch, 1000 epochs, as fit would size the schedule
    assert seen and set(seen) == {(4000, 1000, 2, True)}
    optimizer = json.loads(report.to_json())["workload"]["optimizer"]
    assert (optimizer["class"], optimizer["source"]) == ("torch.optim.SGD", "configure_optimizers")
    assert (optimizer["settings"]["lr"], optimizer["settings"]["momentum"]) == (0.05, 0.9)
    assert optimizer["schedulers"] == ["torch.optim.lr_scheduler.OneCycleLR"]
    assert optimizer["groups"][0]["lr"] == pytest.approx(0.05 / 25)  # the trials train at the schedule's first lr
    assert model._trainer is None  # the trial's copies had the view for the call; the module was never attached
    notice = report.notices[-1]  # a sentence: "... x 4 steps without checkpointing: batch_size 8 -> 4, ..."
    assert re.match(r"autotune: the module now trains batch \d+ x \d+ steps without checkpointing: ", notice), notice
    # fit's own trainer says what the view said, at the batch size written back
    trainer.fit_loop.max_epochs = 1
    trainer.fit(model, datamodule=data)
    assert seen[-1] == (4, 1, 16 // data.hparams.batch_size, True) and trainer.global_step == 4


def test_a_lightning_module_without_a_batch_size_or_a_loss_is_one_clear_line(tmp_path):
    from autotune.integrations.lightning import tune_trainer

    trainer, model, data, BUDGET = lightning_objects()
    data.setup()
    collate = data.train_dataloader().collate_fn
    del data.hparams["batch_size"]
    data.train_dataloader = lambda: torch.utils.data.DataLoader(data.data, batch_size=8, collate_fn=collate)
    with pytest.raises(UsageError, match="keep no batch_size attribute or hparam"):
        tune_trainer(trainer, model, datamodule=data, budget=BUDGET)
    trainer, model, data, BUDGET = lightning_objects()
    model.training_step = lambda batch, batch_idx: None
    with pytest.raises(UsageError, match="training_step returned NoneType"):
        tune_trainer(trainer, model, datamodule=data, budget=BUDGET, storage=f"sqlite:///{tmp_path}/s.db")


def test_import_autotune_imports_neither_framework():
    code = ("import sys, autotune, autotune.integrations; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""Gradient accumulation (--target-batch-size): a reported limit holds for the accumulated step the user trains.

Every micro-step after the first holds the gradients of those before it while its own forward and backward run; a
trial of one micro-step never did, and missed about the model's gradient bytes (found on Hugging Face's bert-large
rows: 1.26 GiB short at batch 1 x 4). A trial under the target runs two micro-steps in its metered step.
"""

import pytest
import torch

from autotune.execution.predict import fake_tensors, predict_trial
from autotune.execution.trial import run_trial
from autotune.meters import TensorMeter
from autotune.records import Config, TrialSettings, micro_steps
from autotune.training.trainer import Trainer
from autotune.training.workload import Workload


@pytest.fixture
def gpt(tiny_gpt_kwargs):
    return Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=tiny_gpt_kwargs)


def _user_loop_peak(workload: Workload, config: Config, accumulation_steps: int) -> int:
    """The peak of a user's accumulated step after the first (autotune.apply's loop, by hand): metered from the
    second optimizer step on, the optimizer's state made by the first."""
    meter = TensorMeter("cpu")
    with meter.measure() as handle:
        trainer = Trainer(workload, config, torch.device("cpu"))
        trainer.build(prime=False)
        batch = workload.make_batch(trainer.module, config.batch_size)
        trainer.step(batch)  # the optimizer's state, as every step after the first holds it
        handle.reset_peak()
        run = trainer.run
        for _ in range(accumulation_steps):
            with run.autocast():
                loss = workload.loss(run.model, batch) / accumulation_steps
            run.backward(loss)
        run.step(trainer.optimizer)
        peak = handle.peak_bytes()
        trainer.release()
    return peak


def test_micro_steps_are_two_under_the_target_and_one_at_or_over_it():
    assert micro_steps(4, None) == 1
    assert micro_steps(4, 16) == micro_steps(4, 5) == 2
    assert micro_steps(4, 4) == micro_steps(8, 4) == 1
    assert micro_steps(4, 8, world_size=2) == 1 and micro_steps(4, 16, world_size=2) == 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_accumulating_trial_peaks_as_the_users_accumulated_step(gpt, precision):
    config = Config(precision, "0", 2)
    alone = run_trial(gpt, config, device="cpu", meter=TensorMeter(), timed=False)
    accumulating = run_trial(gpt, config, device="cpu", meter=TensorMeter(), timed=False,
                             settings=TrialSettings(target_batch_size=8))
    gradients = sum(p.numel() * 4 for p in gpt.build_model().parameters())
    assert accumulating.status == alone.status == "ok"
    # the first micro-step's gradients stay while the second's activations are made: most of the gradients' bytes
    assert accumulating.peak_bytes - alone.peak_bytes > gradients // 2, (accumulating.peak_bytes, alone.peak_bytes)
    assert accumulating.peak_bytes == _user_loop_peak(gpt, config, accumulation_steps=4)
    assert alone.peak_bytes == _user_loop_peak(gpt, config, accumulation_steps=1)


def test_an_accumulating_trial_is_predicted_to_the_byte(gpt):
    config = Config("fp32", "all", 2)
    settings = TrialSettings(target_batch_size=8)
    measured = run_trial(gpt.unwarmed(), config, device="cpu", meter=TensorMeter(), timed=False, settings=settings)
    predicted = predict_trial(gpt, config, settings=settings, mode=fake_tensors())
    assert predicted.peak_bytes == measured.peak_bytes


def test_a_batch_at_the_target_does_not_accumulate(gpt):
    config = Config("fp32", "0", 8)
    at_target = run_trial(gpt, config, device="cpu", meter=TensorMeter(), timed=False,
                          settings=TrialSettings(target_batch_size=8))
    alone = run_trial(gpt, config, device="cpu", meter=TensorMeter(), timed=False)
    assert at_target.peak_bytes == alone.peak_bytes

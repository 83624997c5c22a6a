"""The venue contract (autotune.execution.work.Venue), the same tests run at every venue this machine has: this
process and a spawned worker (every torchrun rank is tests/execution/test_distributed.py's, under torchrun). Wherever
a trial runs, it measures the same peak, records running out of memory and the model's own failure as outcomes, and
raises bad input in the caller, one line."""

import pytest

from autotune.errors import UsageError
from autotune.execution.spawn import Spawned
from autotune.execution.trial import TrialWork
from autotune.execution.venue import Here
from autotune.records import Config, TrialSettings
from autotune.training.workload import Workload

GPT = {"n_layer": 2, "block_size": 16, "n_embd": 32, "n_head": 2, "vocab_size": 64}
SETTINGS = TrialSettings(measure_steps=1)


@pytest.fixture(scope="module", params=["here", "spawned"])
def venue(request):
    """One venue for the module's tests: a spawned one keeps its warm worker from test to test."""
    if request.param == "here":
        yield Here("cpu")
        return
    with Spawned("cpu") as spawned:
        yield spawned


def _gpt() -> Workload:
    return Workload.from_specs("autotune.examples:TinyGPT", model_kwargs=GPT)


def _work(batch_size: int, budget: int | None = 2**30) -> TrialWork:
    return TrialWork(Config("fp32", "0", batch_size), SETTINGS, budget)


def test_a_trial_measures_the_peak_this_process_measures(venue):
    reference = Here("cpu").run(_gpt(), _work(4))
    m = venue.run(_gpt(), _work(4))
    assert m.status == reference.status == "ok" and m.peak_bytes == reference.peak_bytes
    assert m.samples_per_s and m.step_s and m.config == Config("fp32", "0", 4)


def test_running_out_of_memory_is_an_outcome_with_what_it_needed(venue):
    m = venue.run(_gpt(), _work(64, budget=200_000))
    assert m.status == "oom" and m.oom_needed_bytes > 200_000 and m.peak_bytes is not None


def test_the_models_own_failure_is_an_outcome_with_its_first_line(venue):
    m = venue.run(Workload.from_specs("tests.models:ForwardRaises"), _work(2))
    assert m.status == "failed" and m.error == "ValueError: shapes do not match in my layer"


def test_bad_input_is_raised_in_the_caller_in_one_line(venue):
    with pytest.raises(UsageError, match="NoLoss returned a Tensor with no loss") as info:
        venue.run(Workload.from_specs("tests.models:NoLoss"), _work(2))
    assert "\n" not in str(info.value)

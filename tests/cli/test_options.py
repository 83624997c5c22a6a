"""Options: one frozen object for the CLI and the API, checked and parsed when it is made."""

import dataclasses

import pytest

from autotune.__main__ import build_parser, options_from
from autotune.errors import UsageError
from autotune.options import Options


def test_values_are_parsed_once_into_bytes_and_tuples():
    o = Options(model="m:M", budget="1GiB", budgets="2GiB,1GiB,512MiB", batch_sizes="4..16", precisions="bf16,fp32",
                segments="0,2,all", fp32_modules="LayerNorm, Softmax")
    assert o.budget == 2**30 and o.budgets == (2**29, 2**31)  # the budget itself is not repeated
    assert o.memory.all == (2**30, 2**29, 2**31) and o.memory.enforced == 2**31
    assert o.batch_sizes == (4, 8, 16) and o.precisions == ("bf16", "fp32") and o.segments == ("0", "2", "all")
    assert o.fp32_modules == ("LayerNorm", "Softmax")
    assert o.guard.fp32_modules == ("LayerNorm", "Softmax") and o.trial_settings.timeout_s == 300.0
    assert o.probe_settings.fraction == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.budget = 3
    assert dataclasses.replace(o) == o  # made again from its own parsed values: the same options


def test_without_a_budget_the_largest_of_budgets_is_the_budget():
    o = Options(model="m:M", budgets="8GiB,24GiB")
    assert o.budget == 24 * 2**30 and o.budgets == (8 * 2**30,)
    assert Options(model="m:M").budget is None  # the device's memory, resolved by the tuner's first stage


def test_auto_and_lists_are_read_the_same_from_text_and_from_python():
    assert Options(model="m:M", segments="auto").segments is None
    assert Options(model="m:M", segments=[0, 2]).segments == Options(model="m:M", segments="0,2").segments == ("0", "2")
    assert Options(model="m:M", precisions="auto").precisions is None


@pytest.mark.parametrize("kwargs, message", [
    ({"headroom": 1.0}, "--headroom"),
    ({"headroom": float("nan")}, "finite"),
    ({"measure_steps": 0}, "--measure-steps"),
    ({"settle_steps": -1}, "--settle-steps"),
    ({"trial_timeout": -1}, "--trial-timeout"),
    ({"probe_fraction": 0}, "--probe-fraction"),
    ({"clip_grad_norm": 0}, "--clip-grad-norm"),
    ({"target_batch_size": 0}, "--target-batch-size"),
    ({"isolation": "thread"}, "--isolation"),
    ({"strategy": "random"}, "--strategy"),
    ({"n_trials": 5}, "--n-trials"),
    ({"budget": "lots"}, "cannot read the size"),
    ({"budgets": ","}, "--budgets"),
    ({"batch_sizes": "3..3"}, "no power of two"),
    ({"precisions": "fp8"}, "unknown precision"),
    ({"segments": "two"}, "segments"),
])
def test_bad_input_fails_when_the_options_are_made(kwargs, message):
    with pytest.raises(UsageError, match=message):
        Options(model="m:M", **kwargs)


def test_the_cli_builds_the_same_options_as_the_api():
    args = build_parser().parse_args(["--model", "m:M", "--budget", "1GiB", "--segments", "0,2", "--no-probe",
                                      "--fp32-modules", "LayerNorm", "--batch-sizes", "2,4"])
    assert options_from(args) == Options(model="m:M", budget=2**30, segments=("0", "2"), probe=False,
                                         fp32_modules=("LayerNorm",), batch_sizes=(2, 4))

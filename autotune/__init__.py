"""autotune: find the fastest way to train a PyTorch model inside a memory budget, by measuring it.

Use it from the command line (``python -m autotune --model mymodule:Model --budget 24GiB``) or
from Python::

    import autotune
    report = autotune.tune("autotune.examples:TinyGPT", device="cpu", budget="1GiB")
    report.recommendation, report.pareto, report.to_dataframe(), report.to_json("out.json")
    run = autotune.apply(model, report)  # checkpoint plan, autocast, GradScaler, accumulation

The records and the report (``load``, ``Report``, ``Measurement``, ``Config``, ...) import without
torch; the names that train (``tune``, ``apply``, ``run_trial``, meters, checkpointing) load torch
the first time they are used (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# optuna (the trial store, no torch) is imported with the package, not under the first call that needs it: optuna
# keeps the ImportError of each optional backend it lacks (redis), and that traceback holds every frame that was
# running the import, so a first import under tune() or tune_trainer() would keep the caller's model, trainer and
# process groups alive until the interpreter exits (test_tuner: test_tune_lets_go_of_everything_its_caller_held).
import optuna  # noqa: F401

from autotune.errors import AutotuneError, Interrupted, NothingFits, StateDoesNotFit, TrialTimeoutError, UsageError, is_oom
from autotune.records import (
    Config,
    GuardRails,
    Measurement,
    PlanCheck,
    ProbeResult,
    ProbeSettings,
    TrialSettings,
    accumulation_plan,
)
from autotune.report import Report, load
from autotune.search.space import SearchSpace
from autotune.units import format_bytes, parse_size

from autotune._version import __version__

# Names whose modules import torch: loaded on first use.
_LAZY = {
    "tune": "autotune.tuner",
    "Options": "autotune.options",
    "apply": "autotune.training.applied",
    "Applied": "autotune.training.applied",
    "run_trial": "autotune.execution.trial",
    "Workload": "autotune.training.workload",
    "Meter": "autotune.meters",
    "TensorMeter": "autotune.meters",
    "MemoryReading": "autotune.meters",
    "make_meter": "autotune.device",
    "Chain": "autotune.plans.checkpointing",
    "AppliedPlan": "autotune.plans.checkpointing",
    "find_chain": "autotune.plans.checkpointing",
    "apply_plan": "autotune.plans.checkpointing",
    "remove_plan": "autotune.plans.checkpointing",
    "check_plans": "autotune.execution.plan_check",
    "BudgetExceededError": "autotune.meters.oom",
}

if TYPE_CHECKING:
    from autotune.training.applied import Applied, apply
    from autotune.plans.checkpointing import AppliedPlan, Chain, apply_plan, find_chain, remove_plan
    from autotune.device import make_meter
    from autotune.meters import MemoryReading, Meter, TensorMeter
    from autotune.meters.oom import BudgetExceededError
    from autotune.options import Options
    from autotune.execution.plan_check import check_plans
    from autotune.execution.trial import run_trial
    from autotune.tuner import tune
    from autotune.training.workload import Workload


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__", "tune", "Options", "apply", "Applied", "accumulation_plan", "Report", "load", "Measurement", "Config",
    "SearchSpace", "TrialSettings", "GuardRails", "ProbeSettings", "ProbeResult", "run_trial", "Workload", "Meter",
    "TensorMeter", "MemoryReading", "make_meter", "Chain", "AppliedPlan", "find_chain", "apply_plan", "remove_plan",
    "PlanCheck", "check_plans", "AutotuneError", "UsageError", "Interrupted", "NothingFits", "StateDoesNotFit",
    "BudgetExceededError", "TrialTimeoutError",
    "is_oom", "parse_size", "format_bytes",
]

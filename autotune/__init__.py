"""autotune: find the fastest way to train a PyTorch model inside a memory budget, by measuring it.

Use it from the command line (``python -m autotune --model mymodule:Model --budget 24GiB``) or
from Python::

    import autotune
    report = autotune.tune("autotune.examples:TinyGPT", device="cpu", budget="1GiB")
    report.recommendation, report.pareto, report.to_dataframe(), report.to_json("out.json")
    run = autotune.apply(model, report)  # checkpoint plan, autocast, GradScaler, accumulation
"""

__version__ = "0.1.0"

from autotune.apply import Applied, accumulation_plan, apply
from autotune.checkpointing import AppliedPlan, Chain, apply_plan, find_chain, remove_plan
from autotune.plan_check import PlanCheck, check_plans
from autotune.errors import (
    AutotuneError,
    BudgetExceededError,
    Interrupted,
    TrialTimeoutError,
    UsageError,
    is_oom,
)
from autotune.meters import MemoryReading, Meter, TensorMeter, make_meter
from autotune.report import Report, load
from autotune.space import Config, SearchSpace
from autotune.probe import ProbeResult, ProbeSettings
from autotune.trial import GuardRails, Measurement, TrialSettings, run_trial
from autotune.tuner import tune
from autotune.units import format_bytes, parse_size
from autotune.workload import Workload

__all__ = [
    "__version__",
    "tune",
    "apply",
    "Applied",
    "accumulation_plan",
    "Report",
    "load",
    "Measurement",
    "Config",
    "SearchSpace",
    "TrialSettings",
    "GuardRails",
    "ProbeSettings",
    "ProbeResult",
    "run_trial",
    "Workload",
    "Meter",
    "TensorMeter",
    "MemoryReading",
    "make_meter",
    "Chain",
    "AppliedPlan",
    "find_chain",
    "apply_plan",
    "remove_plan",
    "PlanCheck",
    "check_plans",
    "AutotuneError",
    "UsageError",
    "Interrupted",
    "BudgetExceededError",
    "TrialTimeoutError",
    "is_oom",
    "parse_size",
    "format_bytes",
]

"""The tuner's first three stages: the options resolved on this machine, the model looked at once, the study.

    Options -> resolve -> Target          the device's backend, the venue, the workload, budgets, the data's worst
                                          batches, and every option resolved to the value the stages use
            -> preflight -> ModelFacts    the model built once: its size, its optimizer's state, its blocks, its library's switch
            -> plan_study -> Study        the plans checked on the model, the space, the study's identity

The options are used up in ``resolve`` (:mod:`~autotune.preparation.target`): the stages after it read resolved
values (budget bytes, the asked space, trial, search and probe settings), never a flag.
:mod:`~autotune.preparation.model` is stage 2 and :mod:`~autotune.preparation.study` stage 3;
:mod:`autotune.tuner` runs them, then the search, the analysis, the probe and the comparison.
"""

from autotune.preparation.model import ModelFacts, floor_facts, preflight
from autotune.preparation.study import Study, describe, plan_study
from autotune.preparation.target import Searching, Target, WorkloadKey, resolve

__all__ = ["Target", "Searching", "WorkloadKey", "ModelFacts", "Study", "resolve", "preflight", "plan_study",
           "describe", "floor_facts"]

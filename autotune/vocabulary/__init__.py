"""The ground floor: the words every other part of autotune uses, and nothing else (no torch, no other part).

* :mod:`~autotune.vocabulary.plan`: checkpoint plans (:class:`Plan`), their modifiers and offload modes
  (:class:`Offload`), the selective plans;
* :mod:`~autotune.vocabulary.precision`: the precision modes by name;
* :mod:`~autotune.vocabulary.compile`: ``torch.compile``'s modes by name (``none``: eager);
* :mod:`~autotune.vocabulary.config`: a configuration of the search (:class:`Config`) and its
  :class:`Variant` (all but the batch size);
* :mod:`~autotune.vocabulary.autocast`: CUDA's autocast policies (:class:`AutocastPolicy`), which a plan for CUDA
  applies on the CPU;
* :mod:`~autotune.vocabulary.modes`: where a trial's training runs (:class:`Parallel`, :class:`Isolation`);
* :mod:`~autotune.vocabulary.status`: how a trial ended (:class:`Status`) and how a plan's check did
  (:class:`CheckStatus`);
* :data:`HEADROOM`: the share of a budget a recommendation leaves free by default.

Below it only :mod:`autotune.errors`, :mod:`autotune.units` and :mod:`autotune._log`. Every floor above reads
these names from here; ``tests/test_house.py`` checks that no part imports a part that imports it back.
"""

from autotune.vocabulary.plan import (ALL, MODIFIERS, NONE, SELECTIVE, Modifier, Offload, Plan, Selective, auto_plans,
                                      parse_offload, parse_plans, plan_order, with_offload)
from autotune.vocabulary.compile import COMPILE_MODES, DEFAULT, EAGER, STATIC, compile_label, compile_mode, is_static, parse_compile, static_of
from autotune.vocabulary.config import Config, Variant
from autotune.vocabulary.precision import (FSDP_ONLY, GROWTH_INTERVAL, HALF, INIT_LOSS_SCALE, NOT_OFFERED,
                                           PRECISION_NAMES, PRECISIONS, ROUNDING_NOTE, SIXTEEN_BIT, STOCHASTIC_ROUNDING,
                                           TRUE, Precision, PrecisionName, rounding_notice, runs_where)
from autotune.vocabulary.autocast import AutocastPolicy
from autotune.vocabulary.modes import Isolation, Parallel
from autotune.vocabulary.status import CheckStatus, Status

HEADROOM = 0.1  # the share of the budget a recommendation leaves free (--headroom's default)

__all__ = ["Plan", "Selective", "Offload", "Modifier", "MODIFIERS", "NONE", "ALL", "SELECTIVE", "parse_plans",
           "parse_offload", "plan_order", "auto_plans", "with_offload", "Precision", "PrecisionName", "PRECISIONS",
           "PRECISION_NAMES", "DEFAULT",
           "HALF", "SIXTEEN_BIT", "FSDP_ONLY", "TRUE", "NOT_OFFERED", "ROUNDING_NOTE",
           "STOCHASTIC_ROUNDING", "rounding_notice", "runs_where", "INIT_LOSS_SCALE",
           "GROWTH_INTERVAL", "Status", "CheckStatus", "HEADROOM", "EAGER", "COMPILE_MODES", "compile_label", "parse_compile", "Config", "Variant",
           "STATIC", "compile_mode", "is_static", "static_of", "Parallel", "Isolation",
           "AutocastPolicy"]

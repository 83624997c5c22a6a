"""Checkpoint plans applied to a model: what a plan (:class:`autotune.vocabulary.Plan`) does to the user's blocks.

* :mod:`~autotune.plans.checkpointing`: the blocks found and wrapped, each recomputed with its own call's arguments;
* :mod:`~autotune.plans.selective`: the per-operation policies of the ``sac-*`` plans;
* :mod:`~autotune.plans.offload`: what a plan keeps for the backward pass held in host memory (``+offload``);
* :mod:`~autotune.plans.floor`: the least a step needs (batch 1, every block recomputed), when nothing fits.

The plans' names and rules are the ground floor's (:mod:`autotune.vocabulary.plan`); ``from autotune.plans import
Plan`` still works for code written against earlier versions. Whether a plan changes the model is checked where
trials run (:mod:`autotune.execution.plan_check`).
"""

from autotune.vocabulary.plan import (ALL, NONE, SELECTIVE, Offload, Plan, Selective, auto_plans, parse_plans,
                                      plan_order, with_offload)

__all__ = ["Plan", "Selective", "Offload", "NONE", "ALL", "SELECTIVE", "parse_plans", "plan_order", "auto_plans",
           "with_offload"]

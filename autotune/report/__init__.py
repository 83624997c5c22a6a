"""The result of a search: the :class:`Report` record and its JSON, with a versioned schema and its migration.

What a report says is derived, not stored: its front, limits and recommendation come from the
trials through :mod:`autotune.analysis`. Beside it: the pandas frame (:mod:`autotune.report.frame`)
atomic file writing (:mod:`autotune.report.files`), the text table (:mod:`autotune.report.table`, ``Report.table()``)
and, when nothing fits, the figures that say by how much (:mod:`autotune.report.shortfall`; the command line words
them as advice, :mod:`autotune.cli.advice`). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from autotune.analysis.exact import exact_limits
from autotune.analysis.memory_model import MemoryModel
from autotune.analysis.pareto import PREDICTED_TIE, LineRule, batch_limits, choose, pareto_front, recommend
from autotune.vocabulary import EAGER, Plan, Variant
from autotune.records import GuardRails, Measurement, PlanCheck, ProbeResult, accumulation_plan, usable_bytes
from autotune.report.files import write_atomically
from autotune.report.sections import SearchSection

if TYPE_CHECKING:
    from autotune.report.shortfall import Shortfall

__all__ = ["SCHEMA_VERSION", "Report", "SearchSection", "load", "variant_of"]

# 2: checkpoint plans by name ("segments": "2", "all", "every2"), the blocks, plan_checks.
# 3: the gradient-accumulation plan is "accumulation" (was "plan"); oom trials hold oom_held_bytes and
#    oom_needed_bytes; probe candidates peak_reserved_bytes_max.
# 4: the workload names its optimizer ("optimizer": name, kwargs, state_bytes), its "step" and the "fixed_bytes" a step
#    holds whatever the batch (weights, gradients, optimizer state); older reports trained with AdamW. Trials hold
#    setup_s and steps_s, and the search their sums.
# 5: compiled training (--compile): a trial's configuration names its "compile" mode ("none": eager) and a compiled
#    trial its compile_s, compiles and graph_breaks; limits rows, memory lines and plan checks name the compile mode,
#    the search's space lists its modes under "compile".
SCHEMA_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)


def _from_version_1(data: dict[str, Any]) -> dict[str, Any]:
    """A report of schema version 1 in version 2's terms: segment counts become plan names.

    Version 1 grouped the blocks of each segment into one recompute unit; the plan of the same
    name now recomputes the same blocks one by one (the trials' figures stay as measured).
    """
    search = dict(data["search"])
    space = dict(search.get("space") or {})
    if "segments" in space:
        space["segments"] = [Plan(s) for s in space["segments"]]
    search["space"] = {**space, "blocks": (data["workload"].get("chain") or {}).get("length")}
    library = data.get("library_checkpointing")
    if library and "autotune" in library:
        library = {**library, "autotune": {**library["autotune"], "segments": Plan(library["autotune"]["segments"])}}
    return {**data, "search": search, "library_checkpointing": library}


def variant_of(row: dict[str, Any]) -> Variant:
    """The variant a report's row (a limit, a trial's configuration) is of: a record read back, not strings compared."""
    return Variant(row["precision"], Plan(row["segments"]), row.get("compile", EAGER))


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything a search found; the Pareto front, limits and recommendation derive from the trials."""

    environment: dict[str, Any]
    workload: dict[str, Any]
    budget_bytes: int | None
    headroom: float
    search: SearchSection  # a mapping given here is read as one (SearchSection.from_dict)
    trials: tuple[Measurement, ...]
    notices: tuple[str, ...] = ()
    guard: GuardRails = GuardRails()
    probe: tuple[ProbeResult, ...] | None = None  # None when the probe did not run
    probe_settings: dict[str, Any] | None = None
    target_batch_size: int | None = None
    budgets: tuple[int, ...] = ()  # more budgets to recommend for, from the same trials (--budgets)
    library_checkpointing: dict[str, Any] | None = None  # the library's own per-layer checkpointing, measured beside ours
    plan_checks: tuple[PlanCheck, ...] = ()  # each plan's step compared with the plan-free step, before the search
    data: dict[str, Any] | None = None  # with --data: the item sizes, how they were found, which batches were used
    distributed: dict[str, Any] | None = None  # --parallel: backend, world_size, wrapper, mixed precision, isolation
    predictions: tuple[Measurement, ...] = ()  # what auto started from: configurations predicted under fake tensors
    # per precision and plan, the largest evaluation batch during training and for inference alone (autotune.eval_limits);
    # None where they were not looked for (--no-eval-limits, a report from before them)
    eval_limits: tuple[dict[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "search", SearchSection.from_dict(self.search))  # a section as it is

    @property
    def memory_model(self) -> MemoryModel:
        """``peak = fixed + per_sample x batch`` per variant (precision, plan, compile mode), fitted to the trials."""
        space = self.search.space or {}
        variants = [Variant(p, s, c) for c in space.get("compile") or (EAGER,) for p in space.get("precisions", ())
                    for s in space.get("segments", ())]
        hint = self.workload.get("fixed_bytes")  # weights, gradients, optimizer state; before schema 4: AdamW's 4x
        if hint is None and self.workload.get("parameter_bytes"):
            hint = 4 * self.workload["parameter_bytes"]
        return MemoryModel.fit(self.trials, variants, fixed_bytes_hint=hint, blocks=space.get("blocks"))

    def for_budget(self, budget_bytes: int | None) -> dict[str, Any]:
        """Limits and recommendation (from the short trials) for another budget, with the same headroom."""
        rec = recommend(self.trials, budget_bytes, self.headroom, tie=self.predicted_tie)
        return {
            "budget_bytes": budget_bytes,
            "limits": self._limits(budget_bytes, model=self.memory_model),
            "recommendation": self._trial_dict(rec) if rec else None,
        }

    def with_trials(self, *trials: Measurement) -> "Report":
        """This report with ``trials`` joined: each takes the place of the trial of its configuration (a timing of a
        memory trial, a measurement taken again), or comes after the others; the one door a trial enters a report by
        after the analysis."""
        kept = {m.config: m for m in self.trials} | {m.config: m for m in trials}
        return dataclasses.replace(self, trials=tuple(kept.values()))

    def limit(self, variant: Variant) -> dict[str, Any] | None:
        """The limits row of ``variant`` (its precision, plan and compile mode), or None where it has none."""
        return next((row for row in self.limits if variant_of(row) == variant), None)

    def eval_limit(self, precision: str, segments: str) -> dict[str, Any] | None:
        """The evaluation limits of the variant (``precision``, plan ``segments``), or None where there are none."""
        return next((row for row in self.eval_limits or () if (row["precision"], row["segments"]) == (precision, segments)),
                    None)

    @property
    def pareto(self) -> list[Measurement]:
        """Feasible trials not beaten on both throughput and peak memory, by ascending peak."""
        return pareto_front(self.trials, self.budget_bytes)

    @property
    def recommendation(self) -> Measurement | None:
        """The configuration to train with, as its trial, or ``None``.

        After a probe: the fastest probed candidate that was not rejected. Without one: the
        fastest trial whose peak fits within ``budget x (1 - headroom)``.
        """
        if self.probe is not None:
            chosen = choose(self.probe)
            return next((m for m in self.trials if chosen is not None and m.config == chosen.config), None)
        return recommend(self.trials, self.budget_bytes, self.headroom, tie=self.predicted_tie)

    @property
    def predicted_tie(self) -> float:
        """How close predicted throughputs must be not to be told apart: the time model's measured median error where
        a benchmark checked it (``search.time_model.checked``), else :data:`PREDICTED_TIE`."""
        checked = (self.search.time_model or {}).get("checked") or {}
        return checked.get("median_abs_error") or PREDICTED_TIE

    @property
    def dry_run(self) -> bool:
        """Whether the trials were predicted (``--dry-run``), not measured: their step times (where a time model priced
        them) and the recommendation are estimates."""
        return bool(self.search.dry_run)

    @property
    def nothing_fits(self) -> bool:
        """Whether the run has no answer (the CLI's exit 3): no recommendation, or in a dry run, which recommends
        nothing, no configuration predicted to fit within ``budget x (1 - headroom)``."""
        if self.dry_run:
            return not any(m.fits(usable_bytes(self.budget_bytes, self.headroom)) for m in self.trials)
        return self.recommendation is None

    @property
    def accumulation(self) -> dict[str, Any] | None:
        """With a target batch size: micro-batch, accumulation steps and effective batch for the recommendation."""
        rec = self.recommendation
        if rec is None or self.target_batch_size is None:
            return None
        return accumulation_plan(rec.batch_size, self.target_batch_size, world_size=rec.world_size)

    @property
    def limits(self) -> list[dict]:
        """Per variant (precision, plan): ``max_batch_size`` that fits, and the smallest batch that does not
        (measured, or implied by a plan that needs no more memory: ``min_oom_implied_by``)."""
        return self._limits(self.budget_bytes)

    @property
    def line_rule(self) -> LineRule | None:
        """Where the variants' memory lines may imply a failing side: the search's rule, from the measured state
        (none before schema 4, whose state was AdamW's 4x the weights, assumed)."""
        optimizer = self.workload.get("optimizer") or {}
        shapes_vary = self.data is not None and self.data.get("shapes_vary", True)  # an older profile: assume they do
        held = {p: sum(parts.values()) for p, parts in (self.workload.get("state_by_precision") or {}).items()
                if None not in parts.values()}  # a true precision's own state (bf16-true), where measured
        return LineRule.of(self.workload.get("fixed_bytes"), optimizer.get("state_bytes") is not None, shapes_vary, held)

    def _limits(self, budget_bytes: int | None, model: MemoryModel | None = None) -> list[dict]:
        space, step = self.search.space or {}, self.search.batch_multiple
        rows = batch_limits(self.trials, budget_bytes, batch_sizes=space.get("batch_sizes"), model=model,
                            plans=space.get("segments", ()), blocks=space.get("blocks"), line_rule=self.line_rule,
                            predictions={m.config: m for m in self.predictions})
        if self.dry_run:  # bisected: exact where the next multiple of --batch-multiple was predicted not to fit
            for row in rows:
                row.update(predicted=True, exact=row["min_oom_batch_size"] is not None
                           and (row["max_batch_size"] or 0) + step >= row["min_oom_batch_size"])
        elif self.predictions and step is not None:  # the search's predictions make each limit exact
            rows = exact_limits(rows, self.trials, {m.config: m for m in self.predictions}, budget_bytes, step)
        return rows

    def to_dict(self) -> dict[str, Any]:
        recommendation = self.recommendation
        return {
            "schema_version": SCHEMA_VERSION,
            "environment": self.environment,
            "workload": self.workload,
            "budget_bytes": self.budget_bytes,
            "headroom": self.headroom,
            "search": self.search.to_dict(),
            "trials": [self._trial_dict(m) for m in self.trials],
            "predictions": [m.to_dict() for m in self.predictions],
            "limits": self.limits,
            "pareto": [self._trial_dict(m) for m in self.pareto],
            "recommendation": self._trial_dict(recommendation) if recommendation else None,
            "accumulation": self.accumulation,
            "guard": self.guard.to_dict(),
            "probe": None if self.probe is None else {
                "settings": self.probe_settings,
                "candidates": [r.to_dict() for r in self.probe],
                "chosen": None if recommendation is None else recommendation.config.to_dict(),
            },
            "memory_model": self.memory_model.to_list(),
            "budgets": [self.for_budget(b) for b in self.budgets],
            "library_checkpointing": self.library_checkpointing,
            "plan_checks": [c.to_dict() for c in self.plan_checks],
            "data": self.data,
            "distributed": None if self.distributed is None else {
                **self.distributed,
                # the recommendation's peak on each rank (the budget holds on every one)
                "rank_peak_bytes": None if recommendation is None or not recommendation.distributed else
                [r["peak_bytes"] for r in recommendation.distributed["ranks"]],
            },
            "notices": list(self.notices),
            **({} if self.eval_limits is None else {"eval_limits": [dict(row) for row in self.eval_limits]}),
        }

    def _trial_dict(self, m: Measurement) -> dict[str, Any]:
        data = {**m.to_dict(), "feasible": m.fits(self.budget_bytes)}
        probed = next((r for r in self.probe or () if r.config == m.config), None)
        if probed is not None:
            data["probe"] = {"accepted": probed.accepted, "reason": probed.reason, "peak_bytes_max": probed.peak_bytes_max,
                             "samples_per_s": probed.samples_per_s}
        return data

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int = 2) -> str:
        """Return the report as JSON text; with ``path``, also write it there (atomically)."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        if path is not None:
            write_atomically(path, text + "\n")  # parallel workers may write the same report at once
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        if not isinstance(data, dict):
            raise ValueError(f"a report is a JSON object, not a {type(data).__name__}")
        if data.get("schema_version") not in READABLE_VERSIONS:
            raise ValueError(f"unsupported schema_version {data.get('schema_version')!r} (this autotune reads "
                             f"{', '.join(map(str, READABLE_VERSIONS))})")
        if data["schema_version"] == 1:
            data = _from_version_1(data)
        return cls(
            environment=data["environment"],
            workload=data["workload"],
            budget_bytes=data["budget_bytes"],
            headroom=data["headroom"],
            search=data["search"],
            trials=tuple(Measurement.from_dict(t) for t in data["trials"]),
            predictions=tuple(Measurement.from_dict(t) for t in data.get("predictions", ())),
            eval_limits=None if data.get("eval_limits") is None else tuple(data["eval_limits"]),
            notices=tuple(data.get("notices", ())),
            guard=GuardRails.from_dict(data.get("guard")),
            probe=None if data.get("probe") is None else tuple(ProbeResult.from_dict(r) for r in data["probe"]["candidates"]),
            probe_settings=None if data.get("probe") is None else data["probe"]["settings"],
            target_batch_size=(data.get("accumulation", data.get("plan")) or {}).get("target_batch_size"),
            budgets=tuple(b["budget_bytes"] for b in data.get("budgets", ())),
            library_checkpointing=data.get("library_checkpointing"),
            plan_checks=tuple(PlanCheck.from_dict(c) for c in data.get("plan_checks", ())),
            data=data.get("data"),
            distributed={k: v for k, v in data["distributed"].items() if k != "rank_peak_bytes"}
            if data.get("distributed") else None,
        )

    def to_dataframe(self):
        """Return one row per trial (pandas), with ``feasible``, ``pareto`` and ``recommended`` flags."""
        from autotune.report.frame import to_dataframe

        return to_dataframe(self)

    def shortfall(self) -> "Shortfall":
        """When nothing fits: by how much, and which levers the search did not try (figures, no advice)."""
        from autotune.report.shortfall import shortfall

        return shortfall(self)

    def table(self) -> str:
        """Return a human-readable summary: every trial, the limits, the front and the recommendation."""
        from autotune.report.table import render

        return render(self)


def load(path: str | os.PathLike) -> Report:
    """Read a report written by :meth:`Report.to_json`."""
    with open(path) as f:
        return Report.from_dict(json.load(f))

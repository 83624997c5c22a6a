"""The evaluation batch: after the probe (and in a dry run, after the analysis), the largest evaluation batch of each
precision and plan, while training and for inference alone.

A Trainer's evaluation during training runs a forward pass and the loss under ``torch.no_grad()`` with the training
state resident (the weights and the optimizer's state; the gradients are freed before it: see
:mod:`autotune.training.evaluation`), often over larger batches than training's. Each limit is the largest batch,
in steps of ``--batch-multiple``, whose evaluation peak fits the budget less the headroom, as a training limit is, on
the evaluation data's worst batch of that size (``--eval-data``, else ``--data``, else ``example_batch``), up to
``EVAL_TOP_FACTOR`` times the largest of ``--batch-sizes`` (and the evaluation data's items).

How they are found:

* **predicted** for every precision, under fake tensors (:func:`autotune.execution.eval_pass.predict_eval`, to the
  byte on the CPU), each limit by a secant search (:func:`autotune.analysis.limits.largest_within`): a handful of
  passes. A pass without gradients saves nothing for a backward, so a checkpoint plan (recompute, selective,
  offload) changes nothing in it: each precision's limits are found on one plan's model (the recommendation's, else
  the space's first) and hold for each plan of that precision (``found_with_segments`` names the plan).
* **measured** for the recommended variant where the device has the memory: real passes at the limit and the
  size above it (the limit moved where they disagree with the prediction), at the search's venue.

Each row is a precision and plan of the space evaluated eager (a compiled variant's evaluation, compiled again for
``no_grad``, is not sized). Not searched: ``--parallel`` jobs and a run without a budget (said in a notice), and evaluations that generate (``model.generate``, token by token with a key/value cache: said in
``search.eval_limits.not_sized``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

from autotune._log import logger
from autotune.analysis.limits import largest_within
from autotune.device import available_ram_bytes, follows_cuda
from autotune.execution.eval_pass import EvalWork, predict_eval
from autotune.errors import AutotuneError, first_line
from autotune.execution.fake_build import fake_buildable
from autotune.execution.predict import Unpredictable, fake_tensors, quiet_fake_kernels
from autotune.records import PREDICTED, Measurement, usable_bytes
from autotune.report import Report, variant_of
from autotune.search.predicted import let_go
from autotune.training.evaluation import EvalKind, eval_workload
from autotune.vocabulary import EAGER, PRECISIONS, Plan, Status, Variant

if TYPE_CHECKING:
    from autotune.preparation import Study, Target

__all__ = ["eval_limits", "EVAL_TOP_FACTOR", "NOT_SIZED"]

EVAL_TOP_FACTOR = 64  # the largest evaluation batch looked for: this many times the largest of --batch-sizes
NOT_SIZED = ("evaluation batches are sized for a forward pass and its loss under torch.no_grad(); an evaluation "
             "that generates (model.generate: token by token, with a key/value cache growing to the output's length) "
             "is not sized")


def eval_limits(report: Report, target: "Target", study: "Study", *, mode: Any = None) -> Report:
    """The report with ``eval_limits`` (one row per eager precision and plan) and ``search.eval_limits`` (how they
    were found); unchanged with ``--no-eval-limits``; with a notice and no rows where they cannot be found here.
    ``mode``: a dry run's fake tensors (its workload's models are built in them)."""
    if not target.searching.eval_limits:
        return report
    why = _cannot(target)
    if why is not None:
        return _with_notice(report, f"evaluation limits were not looked for: {why}")
    started = time.monotonic()
    variants = list(dict.fromkeys(Variant(v.precision, v.plan) for v in study.space.variants()  # evaluated eager
                                  if not Plan(v.plan).state and not PRECISIONS[v.precision].fsdp_only))
    workload = eval_workload(study.workload, target.eval_data)
    passes = _Passes(workload, target, mode)
    rec = None if report.dry_run else report.recommendation
    try:
        rows = _predicted_rows(variants, rec, passes, report)
        measuring = None if rec is None else Variant(rec.precision, rec.config.plan)  # a compiled one's, eager
        if measuring in variants and passes.measurable:
            measured = _find(passes.measured, measuring, passes, report, hint=_limits_of(rows, measuring))
            rows = [_row(r["precision"], r["segments"], r["segments"], measured)
                    if (r["precision"], r["segments"]) == (rec.precision, rec.config.plan) else r for r in rows]
    except _CannotMeasure as exc:
        return _with_notice(report, f"evaluation limits were not found: the model cannot run under fake tensors "
                                    f"({exc}), and this device cannot hold its passes")
    except Exception as exc:  # noqa: BLE001 - limits beside the search's: their failure must not cost the report
        return _with_notice(report, f"evaluation limits were not found ({type(exc).__name__}: {first_line(exc)})")
    summary = {**passes.describe(), "wall_s": round(time.monotonic() - started, 3), "not_sized": NOT_SIZED,
               "measured": [f"{r['precision']}/{r['segments']}" for r in rows if r["source"] == "measured"]}
    logger.info("evaluation limits: %d passes predicted, %d measured, in %.1f s", passes.predicted_passes,
                passes.measured_passes, summary["wall_s"])
    return dataclasses.replace(report, eval_limits=tuple(rows), notices=report.notices + tuple(passes.notices),
                               search=report.search.but(eval_limits=summary))


def _predicted_rows(variants: list[Variant], rec: Measurement | None, passes: "_Passes", report: Report
                    ) -> list[dict[str, Any]]:
    """Each precision's limits predicted on one plan's model (the recommendation's, else the space's first), one row
    per plan of that precision."""
    rows: list[dict[str, Any]] = []
    try:
        with quiet_fake_kernels():
            for precision in dict.fromkeys(v.precision for v in variants):
                plans = [v.plan for v in variants if v.precision == precision]
                plan = rec.config.plan if rec is not None and rec.precision == precision and rec.config.plan in plans \
                    else plans[0]
                found = _find(passes.predicted, Variant(precision, plan), passes, report)
                rows += [_row(precision, p, plan, found) for p in plans]
    finally:
        let_go()
    return rows


def _cannot(target: "Target") -> str | None:
    """Why the evaluation limits cannot be found in this run, or None."""
    if target.job is not None or target.searching.world_size is not None:
        return (f"a --parallel {target.searching.parallel} job evaluates under its wrapper on every rank, which this "
                f"stage does not run")
    if target.budget.bytes is None:
        return "there is no budget to fit them in (pass --budget)"
    return None


def _find(measure: Callable[[Any, EvalKind], Measurement], variant: Variant, passes: "_Passes", report: Report,
          hint: dict[EvalKind, int | None] | None = None) -> dict[EvalKind, dict[str, Any]]:
    """Both limits of ``variant``, each by :func:`largest_within` from ``hint`` (else the training limit, and for
    inference the training state's bytes past the evaluation limit during training)."""
    rows = [r for r in report.limits if (v := variant_of(r)).precision == variant.precision and v.plan == variant.plan]
    row = next((r for r in rows if variant_of(r).compile == EAGER), rows[0] if rows else {})  # eager's, if any
    limit, slope = (hint or {}).get(EvalKind.DURING_TRAINING) or (None, None)
    found = {EvalKind.DURING_TRAINING: passes.search(lambda b: measure(variant.at(b), EvalKind.DURING_TRAINING),
                                                     limit or row.get("max_batch_size") or passes.multiple, slope)}
    training = found[EvalKind.DURING_TRAINING]
    state = (report.workload.get("optimizer") or {}).get("state_bytes")
    limit, slope = (hint or {}).get(EvalKind.INFERENCE) or (None, training["bytes_per_sample"])
    found[EvalKind.INFERENCE] = passes.search(lambda b: measure(variant.at(b), EvalKind.INFERENCE),
                                              limit or _past(training, state, passes.multiple), slope)
    return found


def _past(found: dict[str, Any], state_bytes: int | None, multiple: int) -> int:
    """Where inference's limit lies, about: the limit during training, plus the batch sizes the training state's
    bytes hold at the bytes per sample of the search's last two sizes (the search's own guess, refined by it)."""
    limit, slope = found["max_batch_size"] or multiple, found.get("bytes_per_sample")
    return limit + (int(state_bytes / slope) // multiple * multiple if state_bytes and slope else 0)


def _limits_of(rows: list[dict[str, Any]], variant: Variant) -> dict[EvalKind, tuple[int | None, float | None]]:
    """Each limit of ``variant``'s row and its bytes per sample: where a search of its measurements starts."""
    row = next(r for r in rows if (r["precision"], r["segments"]) == (variant.precision, variant.plan))
    return {kind: (row[f"{kind}_max_batch_size"], row[str(kind)]["bytes_per_sample"]) for kind in EvalKind}


def _row(precision: str, segments: str, found_with: str, found: dict[EvalKind, dict[str, Any]]) -> dict[str, Any]:
    """One ``eval_limits`` object: the issue's four keys, then how each limit was found (``source`` measured where
    the passes at both limits and above them were, else predicted)."""
    measured = all(found[kind]["measured"] for kind in EvalKind)
    return {"precision": precision, "segments": str(segments),
            **{f"{kind}_max_batch_size": found[kind]["max_batch_size"] for kind in EvalKind},
            "source": "measured" if measured else PREDICTED, "found_with_segments": str(found_with),
            **{str(kind): {k: v for k, v in found[kind].items() if k != "measured"} for kind in EvalKind}}


class _Passes:
    """The stage's passes: predicted under fake tensors (measured instead where the model cannot run under them and
    the device can hold it), and measured at the search's venue under the budget less the headroom."""

    def __init__(self, workload: Any, target: "Target", mode: Any) -> None:
        real = getattr(workload.model_factory, "real", None)  # a dry run's fake copies of a model built for real
        self.workload = workload if real is None else dataclasses.replace(workload, model_factory=real)
        self.target, self.mode = target, mode  # a dry run's fake tensors, whose models its workload builds
        self.fake: Any = workload if mode is not None else None  # the workload predictions build, once known
        self.usable = usable_bytes(target.budget.bytes, target.budget.headroom)
        self.multiple = target.searching.batch_multiple
        items = len(workload.dataset) if workload.dataset is not None else None
        self.top = min(EVAL_TOP_FACTOR * max(target.searching.batch_sizes), items or float("inf"))
        self.top_reason = "the evaluation data's items" if items is not None and items == self.top else \
            f"{EVAL_TOP_FACTOR} x the largest of --batch-sizes"
        self.predicted_passes = self.measured_passes = 0
        self.why: str | None = None  # why the model cannot be predicted, once found
        self.notices: list[str] = []
        self.cuda = self._cuda()

    @property
    def measurable(self) -> bool:
        """Whether this device can hold a pass at the budget less the headroom: a dry run's CUDA plan on a machine
        without its GPU cannot; the CPU can while the machine has that much memory available."""
        device, searching = self.target.device, self.target.searching
        if searching.dry_run and follows_cuda(device) and self.target.here.type != "cuda":
            return False
        total = self.target.backend.total_bytes() if follows_cuda(device) else available_ram_bytes()
        return total is None or total >= self.usable

    def _cuda(self) -> Any:
        if not follows_cuda(self.target.device):
            return None
        from autotune.execution.cuda_rules import CudaRules

        searching = self.target.searching
        return CudaRules.for_this_machine(self.target.device, capability=searching.cuda_capability,
                                          context_bytes=searching.cuda_context_bytes)

    def search(self, measure: Callable[[int], Measurement], start: int, slope: float | None = None) -> dict[str, Any]:
        """One limit, from ``start`` (and the bytes per sample ``slope``, where known): the largest size whose pass
        fits, the size above it, their peaks, the bytes per sample near them; ``at_top`` where the top fits; the
        model's own failure as ``error``."""
        found = largest_within(measure, self.usable, self.multiple, int(self.top), start, slope)
        lo, hi, seen = found.max_batch_size, found.min_oom_batch_size, found.measured
        failed = next((m for m in seen.values() if m.status not in (Status.OK, Status.OOM)), None)
        below = sorted(b for b, m in seen.items() if b < lo and m.peak_bytes is not None)
        above = hi if hi is not None and seen[hi].status == Status.OK else None  # an oom's peak is a bound only
        near = below[-1] if below else above
        slope = (round((seen[near].peak_bytes - seen[lo].peak_bytes) / (near - lo)) if lo and near else slope)
        return {"max_batch_size": lo or None, "peak_bytes": seen[lo].peak_bytes if lo else None,
                "next_batch_size": hi, "next_peak_bytes": seen[hi].peak_bytes if hi else None,
                "at_top": hi is None and lo > 0, "passes": len(seen),
                "error": None if failed is None else f"batch {failed.batch_size}: {failed.error}",
                "bytes_per_sample": slope, "measured": not any(seen[b].predicted for b in (lo, hi) if b)}

    def predicted(self, config: Any, kind: EvalKind) -> Measurement:
        """A pass predicted; measured instead once the model is found to need real values (fake tensors cannot run
        it, or a prediction fails where the same pass measured does not), where the device can hold it."""
        if self.why is None:
            try:
                self.predicted_passes += 1
                if self.fake is None:  # a model that cannot be built under fake tensors is copied into them
                    self.mode = fake_tensors()
                    self.fake = fake_buildable(self.workload, self.mode).workload
                m = predict_eval(self.fake, config, kind, device=self.target.here, mode=self.mode,
                                 settings=self.target.trial_settings, cuda=self.cuda)
                if m.status != Status.FAILED or not self.measurable:
                    return m
                real = self.measured(config, kind)
                if real.status == Status.FAILED:
                    return real  # the model's own failure, fake or real
                self._cannot_predict(m.error)
                return real
            except Unpredictable as exc:
                self._cannot_predict(str(exc))
        if not self.measurable:
            raise _CannotMeasure(self.why)
        return self.measured(config, kind)

    def _cannot_predict(self, why: str | None) -> None:
        self.why = why
        self.notices.append(f"the evaluation passes cannot run under fake tensors ({why}): each was measured "
                            f"instead")
        logger.warning(self.notices[-1])

    def measured(self, config: Any, kind: EvalKind) -> Measurement:
        self.measured_passes += 1
        work = EvalWork(config, kind, self.target.trial_settings, int(self.usable))
        return self.target.venue.run(self.workload, work)

    def describe(self) -> dict[str, Any]:
        data = self.target.eval_data
        return {"data": "--eval-data" if data is not None else "--data" if self.workload.dataset is not None
                else "example_batch", "batch_multiple": self.multiple, "top_batch_size": int(self.top),
                "top": self.top_reason, "usable_bytes": int(self.usable), "predicted_passes": self.predicted_passes,
                "measured_passes": self.measured_passes,
                "resident": {str(EvalKind.DURING_TRAINING): "weights and optimizer state; gradients freed (None), as "
                             "a Trainer frees them before it evaluates", str(EvalKind.INFERENCE): "weights"}}


class _CannotMeasure(AutotuneError):
    """A pass can neither be predicted nor measured here."""


def _with_notice(report: Report, notice: str) -> Report:
    logger.info(notice)
    return dataclasses.replace(report, notices=report.notices + (notice,))

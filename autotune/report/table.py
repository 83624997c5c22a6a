"""The text table a run prints: every trial, the limits, the probe, the recommendation and the other budgets.

Read from a :class:`~autotune.report.Report` (duck-typed here: this module imports no report, so
that the report's ``table()`` may call it); no torch.
"""

from __future__ import annotations

from typing import Any

from autotune.analysis.pareto import recommend
from autotune.records import usable_bytes
from autotune.units import format_bytes
from autotune.vocabulary import EAGER, Status, compile_label

__all__ = ["render"]


def render(report: Any) -> str:
    """Return a human-readable summary: every trial, the limits, the front and the recommendation."""
    lines = _trial_rows(report)
    lines.append("")
    lines += _search_lines(report)
    lines += _trainable_lines(report)
    lines += _limit_lines(report)
    lines += _probe_lines(report)
    lines += _recommendation_lines(report)
    lines += _eval_lines(report)
    if report.library_checkpointing:
        lines.append(_library_line(report.library_checkpointing))
    lines += _budget_lines(report)
    return "\n".join(lines)


def _trial_rows(report: Any) -> list[str]:
    width = max([8, *(len(m.config.plan) for m in report.trials)])  # "sac-linear+offload" as wide as it is
    compiled = any(m.config.compiled for m in report.trials)  # a compile column only where a trial was compiled
    ways = max([7, *(len(compile_label(m.config.compile)) for m in report.trials)]) if compiled else 0
    lines = [f"{'precision':<9} {'segments':>{width}} " + (f"{'compile':<{ways}} " if compiled else "")
             + f"{'batch':>6} {'status':<7} {'peak':>11} {'step_s':>8} {'samples/s':>10}  "]
    pareto = {m.config for m in report.pareto}
    rec = report.recommendation
    for m in report.trials:
        mark = "<- recommended" if rec is not None and m.config == rec.config else ("pareto" if m.config in pareto else "")
        if m.predicted:
            mark = "predicted (dry run: not run)"
        elif m.memory_only:
            mark = "memory trial (not timed)"
        if m.graph_breaks:
            mark = f"{mark}; {m.graph_breaks} graph break(s)".lstrip("; ")
        step = f"{m.step_s:.4f}" if m.step_s is not None else "-"
        sps = f"{m.samples_per_s:.1f}" if m.samples_per_s is not None else "-"
        way = f"{compile_label(m.config.compile):<{ways}} " if compiled else ""
        lines.append(
            f"{m.precision:<9} {m.config.plan:>{width}} {way}{m.batch_size:>6} {m.status:<7} "
            f"{format_bytes(m.peak_bytes):>11} {step:>8} {sps:>10}  {mark}".rstrip()
        )
    if any(m.memory_source == "allocator" for m in report.trials):
        lines.append("compiled trials on the CPU: peaks from the CPU allocator's own events (compiled kernels allocate "
                     "where the tensor meter cannot see), the budget judged after each step, not enforced while it ran")
    return lines


def _named(row: dict[str, Any]) -> str:
    """A limits row's variant: ``fp32/all``, ``fp32/all/compiled``."""
    compile = row.get("compile", EAGER)
    return f"{row['precision']}/{row['segments']}" + ("" if compile == EAGER else f"/{compile_label(compile)}")


def _search_lines(report: Any) -> list[str]:
    """Where the trials' time went: set-up (a worker's start, imports, the model's build) against their steps."""
    search = report.search
    if search.setup_s is None:  # a report from before set-up was measured
        return []
    if report.dry_run:
        return [f"dry run: {search.n_trials} configurations in {search.wall_s:.1f} s, {search.memory_meter}; "
                f"limits exact in steps of {search.batch_multiple} (--batch-multiple)"]
    setup, steps = search.setup_s, search.steps_s
    share = f"{setup / (setup + steps):.0%}, " if setup + steps > 0 else ""
    lines = [f"search: {search.n_trials} configurations in {search.wall_s:.1f} s; the trials spent {setup:.1f} s "
             f"setting up ({share}a worker's start, imports, the model's build) and {steps:.1f} s in steps"]
    seeding = search.predictions or {}
    if seeding.get("not_timed_predicted_slower"):
        lines.append(f"time model ({seeding['time_model']}, median error {seeding['time_error']:.0%} against measured "
                     f"steps): {seeding['not_timed_predicted_slower']} configurations within the budget were not timed, "
                     f"their predicted steps losing to the fastest predicted by more than "
                     f"{2 * seeding['time_error']:.0%} (twice the error)")
    confirmed = search.exact_limit or {}
    if "confirmed" in confirmed:
        lines.append(f"the recommended variant's limit, {confirmed['precision']}/{confirmed['segments']}: "
                     + (f"{confirmed['max_batch_size']} fits and {confirmed['min_oom_batch_size']} does not, the "
                        f"predictions confirmed by a trial at each" if confirmed["confirmed"] else
                        f"the predictions were not confirmed by trials; bisected by trials: "
                        f"{confirmed['max_batch_size']} fits, {confirmed['min_oom_batch_size']} does not"))
    if search.host_budget_source is not None:  # offloaded plans were searched
        held = max((m.host_peak_bytes for m in report.trials if m.host_peak_bytes is not None), default=None)
        budget = search.host_budget_bytes
        lines.append(f"host: offloaded plans (PLAN+offload, PLAN+state) held up to "
                     f"{format_bytes(held) if held else 'nothing'} in host memory, under a host budget of "
                     f"{format_bytes(budget) if budget else 'none'} ({search.host_budget_source})")
    shares = sorted(m.optimizer_step_share for m in report.trials if m.optimizer_step_share is not None)
    if shares:  # the state in host memory: the optimizer steps on the CPU
        lines.append(f"state: with the state in host memory (PLAN+state) the optimizer's step on the CPU took "
                     f"{shares[0]:.0%} to {shares[-1]:.0%} of the step ({len(shares)} timed trials)")
    return lines


def _trainable_lines(report: Any) -> list[str]:
    """Where some parameters are frozen (an adapter over a frozen model): how many train, and that the gradients and
    the optimizer's state counted are theirs alone."""
    workload = report.workload
    total, trainable = workload.get("parameter_count"), workload.get("trainable_parameter_count")
    if not total or trainable is None or trainable >= total:
        return []
    optimizer = workload.get("optimizer") or {}
    name = str(optimizer.get("class") or "the optimizer's").rsplit(".", 1)[-1]
    state = optimizer.get("state_bytes")
    return [f"trainable: {trainable:,} of {total:,} parameters ({trainable / total:.2%}, the rest frozen): every "
            f"step holds gradients of {format_bytes(workload['trainable_parameter_bytes'])}"
            + (f" and {name} state of {format_bytes(state)}" if state is not None else "")
            + f" for those alone, beside {format_bytes(workload['parameter_bytes'])} of weights"]


def _limit_lines(report: Any) -> list[str]:
    lines = []
    if report.distributed:
        d = report.distributed
        lines.append(f"distributed: {d['wrapper']}, world size {d['world_size']}, rank 0 predicted on a fake process "
                     f"group (no job ran); batch sizes and peaks are per rank" if d.get("predicted") else
                     f"distributed: {d['wrapper']}, world size {d['world_size']} ({d['backend']}); batch sizes and "
                     f"peaks are per rank (the largest rank's), samples/s are the whole job's")
    limits = report.limits
    exact = (" (predicted; the next size, in brackets, does not fit)" if report.dry_run else
             " (exact where the next size, in brackets, does not fit)" if any(r.get("exact") for r in limits) else "")
    lines.append(f"largest batch that fits{exact}, per precision and segments: " + ", ".join(
        f"{_named(row)}: {row['max_batch_size'] if row['max_batch_size'] is not None else 'none'}"
        + (f" ({row['min_oom_batch_size']})" if exact and row.get("exact", report.dry_run)
           and row["min_oom_batch_size"] is not None else "")
        for row in limits
    ))
    _implied(lines, [r for r in limits if r.get("min_oom_rule", "nested-plan") == "nested-plan" and "min_oom_implied_by" in r],
             "of these limits end where a plan that needs no more memory ran out of it at the next size (no trial of "
             "its own)", lambda row: f"by {row['min_oom_implied_by']}")
    _implied(lines, [r for r in limits if r.get("min_oom_rule") == "memory-line"],
             f"end where the plan's own memory line (the measured state plus its trials' bytes per sample) predicts "
             f"{report.line_rule.margin:g}x the budget or more at the next size (no trial of its own)" if report.line_rule
             else "", lambda row: f"at {row['min_oom_batch_size']} ({format_bytes(row['min_oom_predicted_bytes'])})")
    standing = ("standing on a trial equal to its prediction within 1% (of the plan, or of another plan of its "
                "precision where no trial contradicted a prediction)")
    _implied(lines, [r for r in limits if r.get("max_rule") == "prediction"],
             f"largest fits are the search's predictions (under fake tensors; no trial of their own), {standing}",
             lambda row: f"at {row['max_batch_size']} ({format_bytes(row['max_predicted_bytes'])} predicted, by "
                         f"{row['max_implied_by']})")
    _implied(lines, [r for r in limits if r.get("min_oom_rule") == "prediction"],
             f"end where the search's prediction says the next size does not fit (no trial of its own), {standing}",
             lambda row: f"at {row['min_oom_batch_size']} ({format_bytes(row['min_oom_predicted_bytes'])} predicted)")
    if report.data:
        d = report.data
        read = "every item" if d["method"] == "exhaustive" else (
            "its lengths attribute" if d["method"] == "lengths" else f"a random sample of {d['read']}")
        lines.append(f"data: {d['items']} items (sizes from {read}): p50 {d['p50']}, p90 {d['p90']}, max {d['max']} "
                     f"({d['size_unit']}); memory measured on the worst batch of each size, steps timed on random "
                     f"batches")
    return lines


def _implied(lines: list[str], rows: list[dict], says: str, each: Any) -> None:
    """One line for the limits ``rows`` whose side was implied, not measured: how many, ``says`` why, and ``each``
    row's variant with what ``each`` says of it."""
    if rows:
        lines.append(f"{len(rows)} {says}: " + ", ".join(f"{_named(row)} {each(row)}"
                                                         for row in rows))


def _probe_lines(report: Any) -> list[str]:
    lines = []
    for r in report.probe or ():
        verdict = "accepted" if r.accepted else f"rejected: {r.reason}"
        speed = f", {r.samples_per_s:.1f} samples/s" if r.samples_per_s else ""
        worst = (f", worst batch {format_bytes(r.worst_batch_peak_bytes)}" if r.worst_batch_peak_bytes is not None
                 else "")
        host = f", host {format_bytes(r.host_peak_bytes)}" if r.host_peak_bytes is not None else ""
        lost = (f"; {r.lost_updates['share']:.0%} of the sampled updates rounded away in bf16 "
                f"({r.lost_updates['lost']:,} of {r.lost_updates['sampled']:,})" if r.lost_updates else "")
        lines.append(f"probe {r.config}: {r.steps} steps, worst-case peak {format_bytes(r.peak_bytes_max)} "
                     f"(trial {format_bytes(r.trial_peak_bytes)}{worst}){host}{speed}; {verdict}{lost}")
    return lines


def _estimate_lines(report: Any, rec: Any, budget: str) -> list[str]:
    """A dry run's recommendation: its memory and its time predicted, an estimate with the model's checked error."""
    model = report.search.time_model or {}
    checked = model.get("checked")
    error = (f"median error {checked['median_abs_error']:.0%} measured ({checked['source']})" if checked
             else f"its error not measured on {model.get('name')}")
    share = f" ({rec.peak_bytes / report.budget_bytes:.0%} of the {budget} budget)" if report.budget_bytes else ""
    front = ", ".join(f"{m.precision}/{m.config.plan}/{m.batch_size}" for m in report.pareto)
    return [f"recommendation (an estimate: predicted, not measured): {rec.precision}, segments {rec.config.plan}, "
            f"batch size {rec.batch_size}: {rec.samples_per_s:.1f} samples/s predicted on {model.get('name')} "
            f"({error}), peak {format_bytes(rec.peak_bytes)} predicted{share}",
            f"predicted Pareto front (time and memory estimates): {front}"]


def _recommendation_lines(report: Any) -> list[str]:
    rec = report.recommendation
    budget = format_bytes(report.budget_bytes) if report.budget_bytes else "none"
    if report.dry_run and rec is not None:
        return _estimate_lines(report, rec, budget)
    if report.dry_run:
        fitting = sum(m.fits(usable_bytes(report.budget_bytes, report.headroom)) for m in report.trials)
        return [f"recommendation: none in a dry run (it predicts memory, not time); {fitting} of its "
                f"{len(report.trials)} configurations fit within {budget} less {report.headroom:.0%} headroom: run "
                f"without --dry-run to measure which is fastest"]
    if rec is None and report.probe:
        return ["recommendation: none: every probed candidate was rejected"]
    if rec is None:
        return [f"recommendation: none fits within {budget} less {report.headroom:.0%} headroom"]
    probed = next((r for r in report.probe or () if r.config == rec.config), None)
    peak, speed, where = (rec.peak_bytes, rec.samples_per_s, "peak") if probed is None else (
        probed.peak_bytes_max, probed.samples_per_s, "worst-case peak in the probe")
    share = f" ({peak / report.budget_bytes:.0%} of the {budget} budget)" if report.budget_bytes else ""
    way = f", {compile_label(rec.config.compile)} (torch.compile)" if rec.config.compiled else ""
    lines = [f"recommendation: {rec.precision}, segments {rec.config.plan}{way}, batch size {rec.batch_size}: "
             f"{speed:.1f} samples/s, {where} {format_bytes(peak)}{share}"]
    static = report.search.static_compile
    if static and static.get("static_over_dynamic"):
        lines.append(f"compiled static (dynamic=False) at batch {static['batch_size']}: step "
                     f"{static['static_over_dynamic']:.3f}x the dynamic graph's ({static['static_step_s']:.4g} s against "
                     f"{static['dynamic_step_s']:.4g} s, run one after the other), peak "
                     f"{format_bytes(static['static_peak_bytes'])} against {format_bytes(static['dynamic_peak_bytes'])}")
    elif static:
        lines.append(f"compiled static (dynamic=False) at batch {static['batch_size']}: {static['static_status']}")
    accumulation = report.accumulation
    if accumulation and accumulation["target_batch_size"]:
        ranks = f" x {accumulation['world_size']} ranks" if accumulation.get("world_size", 1) > 1 else ""
        lines.append(f"accumulation: {accumulation['accumulation_steps']} x {accumulation['micro_batch_size']}"
                     f"{ranks} = effective batch {accumulation['effective_batch_size']}; {accumulation['lr_note']}")
    return lines


def _eval_lines(report: Any) -> list[str]:
    """The evaluation limits, one entry per precision where its plans have the same (a pass without gradients saves
    nothing for a plan to change): during training / for inference alone, and which were measured."""
    rows = report.eval_limits
    if not rows:
        return []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["precision"], row["during_training_max_batch_size"], row["inference_max_batch_size"])
        groups.setdefault(key, []).append(row)

    def size(row: dict[str, Any], kind: str) -> str:
        limit = row[f"{kind}_max_batch_size"]
        return "none" if limit is None else f"{limit}+" if row[kind]["at_top"] else str(limit)

    parts = []
    for (precision, _, _), group in groups.items():
        every = len(group) == sum(r["precision"] == precision for r in rows)
        measured = [r["segments"] for r in group if r["source"] == "measured"]
        source = "predicted" if not measured else "measured" if len(measured) == len(group) else \
            f"plan {', '.join(measured)} measured, the others predicted"
        which = "every plan" if every else "plan " + ", ".join(r["segments"] for r in group)
        parts.append(f"{precision} ({which}): {size(group[0], 'during_training')} / {size(group[0], 'inference')} "
                     f"({source})")
    search = report.search.eval_limits or {}
    top = f"; N+: the largest looked for ({search['top']})" if any(r[k]["at_top"] for r in rows for k in (
        "during_training", "inference")) and search.get("top") else ""
    return [f"largest evaluation batch (forward and loss under torch.no_grad(), on the worst batch of "
            f"{search.get('data', 'the data')}; within the budget less headroom), during training (weights and optimizer "
            f"state resident) / for inference alone: " + "; ".join(parts) + top]


def _budget_lines(report: Any) -> list[str]:
    lines = []
    for budget in report.budgets:
        other = recommend(report.trials, budget, report.headroom, tie=report.predicted_tie)
        limits = ", ".join(f"{_named(r)}: {r['max_batch_size'] or 'none'}"
                           + ("" if r.get("bracketed", True) else f" (model: {r.get('predicted_max_batch_size') or 'none'})")
                           for r in report.for_budget(budget)["limits"])
        lines.append(f"budget {format_bytes(budget)}: " + (
            f"{other.precision}, segments {other.config.plan}{', compiled' if other.config.compiled else ''}, batch size "
            f"{other.batch_size}: {other.samples_per_s:.1f} "
            f"samples/s, peak {format_bytes(other.peak_bytes)}" if other else "nothing fits") + f"; largest batch: {limits}")
    return lines


def _library_line(c: dict[str, Any]) -> str:
    def one(r: dict[str, Any]) -> str:
        if r["status"] != Status.OK:
            return f"{r['status']} (peak {format_bytes(r['peak_bytes'])})"
        if r["samples_per_s"] is None:  # a memory trial of the search: its peak, no speed
            return f"peak {format_bytes(r['peak_bytes'])} (a memory trial: not timed)"
        return f"peak {format_bytes(r['peak_bytes'])}, {r['samples_per_s']:.1f} samples/s"

    parts = [f"{c['method']} (every block): {one(c['library'])}",
             f"autotune segments {c['autotune']['segments']}: {one(c['autotune'])}"]
    if c.get("none"):
        parts.append(f"no checkpointing: {one(c['none'])}")
    return f"library checkpointing at {c['precision']}, batch {c['batch_size']}: " + "; ".join(parts)

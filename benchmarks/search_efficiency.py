"""Search efficiency: `auto` vs `grid` vs the batch-size finders people use today, in one run.

    python benchmarks/search_efficiency.py [--models TinyGPT,ResNetish] [--budget 1GiB] [--measure-steps 5]

Per bundled model, on the CPU (or --device), under one budget, precisions fp32,bf16, segments
auto, batch sizes 1..256:

* ``grid``: every configuration, ``autotune.tune(strategy="grid")`` from an empty store.
* ``auto``: ``autotune.tune(strategy="auto")`` from an empty store.
* ``lightning-style``: per (precision, plan), Lightning's batch-size finder in ``binsearch`` mode
  over the batch sizes of the space: double from the smallest until a trial runs out of memory,
  then bisect between the last fit and the first failure.
* ``accelerate-style``: per (precision, plan), accelerate's ``find_executable_batch_size``: start
  at the largest size, after every out-of-memory try 90% of it (here: the largest size of the
  space at most 90% of it), until one fits.

The two finder emulations only search the batch axis; they take each trial from the grid's
measurements (the same configuration measures the same), and their seconds are the grid's
seconds for those trials. Their recommendation is the fastest of the largest batches they found.

* ``lightning`` and ``accelerate``: the real ``Tuner.scale_batch_size(mode="binsearch")`` and
  ``find_executable_batch_size`` (when installed), on the plan without checkpointing in fp32 and
  bf16, inside autotune's tensor meter with the same budget: its error is a
  ``torch.OutOfMemoryError`` both recognise. They search every integer, not the space's sizes.

Then, unless ``--no-default-run``: ``python -m autotune --model autotune.examples:TinyGPT --data
autotune.examples:token_dataset --device cpu --budget 1GiB`` with every other flag at its default
(all precisions, ``--segments auto``, 1..512, the probe, the library comparison), from an empty
store, timed end to end.

``--real-finders-only`` reruns just the real finders into an existing results JSON. ``--replay``
replays ``auto`` on the committed grid reports (:func:`replay`) in under a second: the bracket
exactly, the climb with the grid's times; for working on the strategy between full runs.

Writes ``results/search_efficiency-<device>.json`` and ``.md`` (with the environment) and each
grid report as ``results/grid-<model>-<device>.json``, which ``benchmarks/claims.py`` reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import autotune
from autotune.device import backend_for
from autotune.meters import TensorMeter
from autotune.analysis.pareto import LineRule, batch_limits, line_failures, recommend
from autotune.vocabulary import Plan
from autotune.records import Config, Measurement
from autotune.search.space import SearchSpace
from autotune.units import format_bytes, parse_size
from autotune.training.workload import Workload

MODELS = {"TinyGPT": "autotune.examples:TinyGPT", "ResNetish": "autotune.examples:ResNetish"}


def lightning_style(sizes, measured):
    """Double from the smallest size until out of memory, then bisect (over the space's indices)."""
    tried, i, lo, hi = [], 0, -1, None
    while i < len(sizes):  # power phase: doubling the batch is the next size of a powers-of-two space
        tried.append(sizes[i])
        if not measured[sizes[i]].fits:
            hi = i
            break
        lo, nxt = i, next((j for j, b in enumerate(sizes) if b >= 2 * sizes[i]), len(sizes))
        i = nxt
    while hi is not None and hi - lo > 1:  # binsearch phase
        mid = (lo + hi) // 2
        tried.append(sizes[mid])
        lo, hi = (mid, hi) if measured[sizes[mid]].fits else (lo, mid)
    return tried, (sizes[lo] if lo >= 0 else None)


def accelerate_style(sizes, measured):
    """Start at the largest size; after each out-of-memory, the largest size at most 90% of the last."""
    tried, b = [], max(sizes)
    while b is not None:
        tried.append(b)
        if measured[b].fits:
            return tried, b
        b = max((s for s in sizes if s <= int(b * 0.9)), default=None)
    return tried, None


class _Trial:
    def __init__(self, m, budget):
        self.m, self.fits = m, m.fits(budget)


def finder_rows(grid, budget, headroom):
    sizes = sorted(grid.search["space"]["batch_sizes"])
    by_plan = {}
    for m in grid.trials:
        by_plan.setdefault(m.config.variant, {})[m.batch_size] = _Trial(m, budget)
    rows = {}
    for name, finder in (("lightning-style", lightning_style), ("accelerate-style", accelerate_style)):
        trials, found, seconds = 0, {}, 0.0
        for plan, measured in by_plan.items():
            tried, largest = finder(sizes, measured)
            trials += len(tried)
            seconds += sum(measured[b].m.wall_s for b in tried)
            found[plan] = largest
        picks = [by_plan[plan][b].m for plan, b in found.items() if b is not None]
        rec = recommend(picks, budget, headroom) or recommend(picks, budget, 0.0)
        rows[name] = {"trials": trials, "trial_seconds": round(seconds, 1), "limits": found, "recommendation": rec}
    return rows


def measured_state(report) -> tuple[float | None, str]:
    """The fixed state a grid report's model holds (weights, gradients, optimizer state): the report's own where it
    measured it (schema 4), else measured now as the tuner measures it (AdamW, the report's model and kwargs)."""
    optimizer = report.workload.get("optimizer") or {}
    if optimizer.get("state_bytes") is not None:
        return report.workload["fixed_bytes"], "the report's"
    from autotune.training.optimizer import OptimizerSpec, measure_state_bytes

    workload = Workload.from_specs(report.workload["model"], model_kwargs=report.workload.get("model_kwargs"))
    model = workload.build_model(seed=0)
    state = measure_state_bytes(OptimizerSpec(), model, 1e-4)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return (None if state is None else 2 * weights + state), "measured now"


def oracle(report) -> dict:
    """The fewest trials that know every limit of a grid report: an oracle that knows each boundary beforehand.

    It measures each variant's largest fitting batch (or, where none fits, its smallest), times the
    grid's recommendation (a point of its variant's line too), and measures each next size up
    unless the rules auto uses imply it from the trials it has: the variant's memory line through
    its trials and the measured state (:class:`~autotune.analysis.pareto.LineRule`), or a measured
    failure at that size of a plan that needs no more memory (chosen greedily, the failure that
    implies the most first). Every trial is the grid's own, so the limits it finds are checked
    against the grid's.
    """
    space = report.search["space"]
    sizes, plans, blocks, budget = sorted(space["batch_sizes"]), space["segments"], space.get("blocks"), report.budget_bytes
    grid = {m.config: m for m in report.trials}
    variants = list(dict.fromkeys(m.config.variant for m in report.trials))
    state, state_source = measured_state(report)
    rule = LineRule.of(state, state is not None, shapes_vary=report.data is not None)
    chosen: dict[Config, Measurement] = {}
    failing: set[Config] = set()
    for variant in variants:
        fits = [b for b in sizes if grid[variant.at(b)].fits(budget)]
        if not fits:
            chosen[variant.at(sizes[0])] = grid[variant.at(sizes[0])]
            continue
        chosen[variant.at(fits[-1])] = grid[variant.at(fits[-1])]
        if fits[-1] != sizes[-1]:
            failing.add(variant.at(sizes[sizes.index(fits[-1]) + 1]))
    recommended = report.recommendation  # timed: a point of the variant's line too, so it comes first
    timed_extra = recommended is not None and recommended.config not in chosen
    if timed_extra:
        chosen[recommended.config] = grid[recommended.config]
    by_line = set(line_failures(chosen.values(), budget, sizes, rule)) & failing
    open_ = failing - by_line
    by_plan = 0
    while open_:  # greedy cover: the measured failure that implies the most open failing sides
        def covers(c: Config) -> set[Config]:
            return {f for f in open_ if f.precision == c.precision and f.batch_size == c.batch_size
                    and (f == c or Plan(c.segments).needs_no_more_memory_than(f.segments, blocks))}
        candidates = [c for c in grid if not grid[c].fits(budget) and grid[c].status in ("oom", "ok") and c not in chosen]
        best = max(candidates, key=lambda c: (len(covers(c)), c in open_))
        covered = covers(best)
        chosen[best] = grid[best]
        by_plan += len(covered - {best})
        open_ -= covered
    found = {(r["precision"], r["segments"]): (r["max_batch_size"], r.get("bracketed"))
             for r in batch_limits(chosen.values(), budget, batch_sizes=sizes, plans=plans, blocks=blocks, line_rule=rule)}
    exact = {(r["precision"], r["segments"]): (r["max_batch_size"], True) for r in report.limits}
    return {"trials": len(chosen), "share_of_grid": round(len(chosen) / len(grid), 3), "variants": len(variants),
            "failing_sides": len(failing), "implied_by_line": len(by_line), "implied_by_plan": by_plan,
            "recommendation_timed_extra": timed_extra, "state_bytes": state, "state_source": state_source,
            "limits_equal_grid": found == exact}


def grid_predictions(report, grid) -> dict:
    """The predictions a search would start from, taken from the grid's trials: on the tensor meter a prediction
    equals the measurement to the byte (``results/dry_run-cpu.md``), so the replay bisects each variant as the
    tuner's prediction stage does, on the grid's peaks, without their times."""
    import dataclasses

    from autotune.records import PREDICTED
    from autotune.search.predicted import predict_space

    def predict(config):
        return dataclasses.replace(grid[config], timed=False, samples_per_s=None, step_s=None, step_times_s=(),
                                   step_s_spread=None, memory_source=PREDICTED)

    limits = (report.budget_bytes,)  # as the tuner's prediction stage: the budget's boundaries
    return predict_space(SearchSpace.from_dict(report.search["space"]), predict, limits, fixed_bytes=report.workload.get("fixed_bytes"))


def replay(report, predictions: dict | None = None) -> list[Measurement]:
    """``auto``'s trials replayed on a grid report's own: each proposal answered by the grid's trial of it.

    Peaks are the same in every run of a configuration (the claims benchmark checks it byte for
    byte), so the bracket replays exactly; step times are the grid's single run's, so the climb and
    the near ties follow one run's noise. A memory trial gets the grid's peaks without its times; a
    near tie timed again keeps its times and counts a second timing. Returns the trials in order
    (a configuration timed again appears twice). Seconds: none, this takes well under one. ``predictions``
    (:func:`grid_predictions`): what the search starts from, as the tuner's prediction stage gives it.
    """
    import dataclasses

    from autotune.search.strategies import AutoStrategy

    grid = {m.config: m for m in report.trials}
    space = SearchSpace.from_dict(report.search["space"])
    strategy = AutoStrategy(headroom=report.headroom, fixed_bytes_hint=report.workload.get("fixed_bytes"),
                            line_rule=report.line_rule, predictions=predictions)
    measured: dict[Config, Measurement] = {}
    order: list[Measurement] = []
    while (proposal := strategy.propose(space, measured, report.budget_bytes)) is not None:
        trial, before = grid[proposal.config], measured.get(proposal.config)
        if before is None and not proposal.timed and trial.status == "ok":
            trial = dataclasses.replace(trial, timed=False, samples_per_s=None, step_s=None, step_times_s=(),
                                        step_s_spread=None)
        elif before is not None and before.timed:
            trial = dataclasses.replace(before, timings=before.timings + 1)
        measured[proposal.config] = trial
        order.append(trial)
        if len(order) > 2 * len(grid):
            raise RuntimeError(f"auto did not end after {len(order)} trials of a space of {len(grid)}")
    return order


def replay_summary(report, predicted: bool = False) -> dict:
    """Replayed auto against the oracle and the grid: trials, their ratio, whether every limit is the grid's."""
    predictions = grid_predictions(report, {m.config: m for m in report.trials}) if predicted else None
    trials = replay(report, predictions)
    space = report.search["space"]
    found = {(r["precision"], r["segments"]): r["max_batch_size"] if r.get("bracketed") else None
             for r in batch_limits(trials, report.budget_bytes, batch_sizes=space["batch_sizes"], plans=space["segments"],
                                   blocks=space.get("blocks"), line_rule=report.line_rule,
                                   predictions=predictions)}
    exact = {(r["precision"], r["segments"]): r["max_batch_size"] for r in report.limits}
    floor = oracle(report)
    chosen = recommend(list({m.config: m for m in trials}.values()), report.budget_bytes, report.headroom)
    return {"trials": len(trials), "oracle": floor["trials"], "vs_oracle": round(len(trials) / floor["trials"], 3),
            "limits_equal_grid": found == exact, "recommendation": None if chosen is None else str(chosen.config),
            "grid_recommendation": None if report.recommendation is None else str(report.recommendation.config)}


class _Batches(torch.utils.data.IterableDataset):
    """The same batch of ``size`` four times, made on iteration.

    It has no length on purpose: Lightning caps the batch size at a sized dataset's length.
    """

    def __init__(self, workload, net, size):
        self.workload, self.net, self.size = workload, net, size

    def __iter__(self):
        batch = self.workload.make_batch(self.net, self.size)
        return iter([batch] * 4)


def real_lightning(model_spec, precision, budget, max_batch, folder):
    """Lightning's own finder on plan 0, inside the tensor meter; None when lightning is not installed."""
    try:
        import lightning as L
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        return None
    workload = Workload.from_specs(model_spec)
    tried = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.batch_size, self.calls = workload.build_model(), 1, 0

        def training_step(self, batch, _):
            self.calls += 1
            if not tried or tried[-1] != self.batch_size:
                tried.append(self.batch_size)
            return workload.loss(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            # The batch is made when iterated, not here: Lightning rebuilds the loader inside its
            # `except` block, while the failed step's tensors are still referenced by the exception.
            return torch.utils.data.DataLoader(_Batches(workload, self.net, self.batch_size), batch_size=None)

    module = Module()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    trainer = L.Trainer(default_root_dir=folder, accelerator="cpu", precision="bf16-mixed" if precision == "bf16" else "32-true", max_steps=4,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    started = time.monotonic()
    with TensorMeter(budget_bytes=budget).measure():
        # margin=0: the boundary itself (Lightning's default then takes 5% off it)
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", init_val=1, max_trials=25, steps_per_trial=3, margin=0.0)
    return {"found": found, "trials": len(tried), "wall_s": round(time.monotonic() - started, 1), "steps": module.calls, "tried": tried}


def real_accelerate(model_spec, precision, budget, start, folder):
    """accelerate's own find_executable_batch_size on plan 0, inside the tensor meter."""
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return None
    workload = Workload.from_specs(model_spec)
    tried = []

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size):
        tried.append(batch_size)
        torch.manual_seed(0)
        net = workload.build_model()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        batch = workload.make_batch(net, batch_size)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = workload.loss(net, batch)
            loss.backward()
            opt.step()
        return batch_size

    started = time.monotonic()
    with TensorMeter(budget_bytes=budget).measure():
        found = train()
    return {"found": found, "trials": len(tried), "wall_s": round(time.monotonic() - started, 1), "tried": tried}


def real_finders(spec, args, grid_limits, memory_model, max_batch, folder):
    """The real Lightning and accelerate finders on the plan without checkpointing, per precision.

    Each row carries the grid's largest batch (in the space's sizes) and the largest integer batch
    that auto's fitted memory line allows, since the real finders search every integer.
    """
    real, budget = [], parse_size(args.budget)
    lines = {(r["precision"], r["segments"]): r for r in memory_model}
    for precision in args.precisions.split(","):
        line = lines.get((precision, "0"))
        model_max = int((budget - line["fixed_bytes"]) // line["per_sample_bytes"]) if line else None
        print(f"{spec}: lightning and accelerate on {precision}, segments 0 ...", file=sys.stderr, flush=True)
        for method, run in (("lightning", real_lightning), ("accelerate", real_accelerate)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = run(spec, precision, budget, max_batch, folder)
            except Exception as exc:  # noqa: BLE001 - a third-party library failing is a result to report
                result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            if result is not None:
                real.append({"method": method, "precision": precision, "segments": "0",
                             "grid_max_batch_size": grid_limits[(precision, "0")], "model_max_batch_size": model_max, **result})
    return real


def run_model(name, args, folder):
    spec = MODELS[name]
    budget = parse_size(args.budget)
    common = dict(device=args.device, budget=budget, precisions=args.precisions, segments="auto", batch_sizes=args.batch_sizes,
                  measure_steps=args.measure_steps, warmup_steps=2, probe=False, trial_timeout=args.trial_timeout)
    reports = {}
    for strategy in ("grid", "auto"):
        print(f"{name}: {strategy} ...", file=sys.stderr, flush=True)
        reports[strategy] = autotune.tune(spec, strategy=strategy, storage=f"sqlite:///{folder}/{name}-{strategy}.db",
                                          study=f"{name}-{strategy}", **common)
    grid, auto = reports["grid"], reports["auto"]
    grid_limits = {(r["precision"], r["segments"]): r["max_batch_size"] for r in grid.limits}
    speed = {m.config: m.samples_per_s for m in grid.trials}  # every ratio uses the grid's own measurement
    best = grid.recommendation
    rows = []

    def row(method, trials, seconds, limits, rec, wall_kind, **more):
        exact = sum(limits.get(plan) == grid_limits[plan] for plan in grid_limits)
        rows.append({
            "method": method, "trials": trials, "trials_share_of_grid": round(trials / grid.search["n_run"], 3),
            "seconds": seconds, "seconds_kind": wall_kind, "plans_exact": exact, "plans": len(grid_limits),
            "recommendation": None if rec is None else str(rec.config),
            "throughput_vs_grid_best": None if rec is None or best is None else round(speed[rec.config] / speed[best.config], 3),
            **more,
        })

    row("grid", grid.search["n_run"], round(grid.search["wall_s"], 1), grid_limits, best, "wall")
    # auto's limit counts only where it is exact at the space's sizes: the largest fit measured or standing on a
    # confirmed prediction, the next size measured or implied; an exact limit between the space's sizes (or above
    # its top) is compared at the largest size of the space it allows
    sizes = sorted(grid.search["space"]["batch_sizes"])
    auto_limits = {(r["precision"], r["segments"]):
                   max((b for b in sizes if b <= (r["max_batch_size"] or 0)), default=None) if r.get("bracketed") else None
                   for r in auto.limits}
    confirming = (auto.search.get("exact_limit") or {}).get("trials", 0)  # the recommended limit's, after the search
    seeding = auto.search.get("predictions") or {}
    row("auto", auto.search["n_run"] + confirming, round(auto.search["wall_s"], 1), auto_limits, auto.recommendation,
        "wall", memory_trials=sum(m.memory_only for m in auto.trials) + sum(
            m.memory_from is not None for m in auto.trials),
        timed_after_memory_trial=sum(m.memory_from is not None for m in auto.trials),
        timed_again=sum(m.timings > 1 for m in auto.trials),
        failures_implied=sum(r.get("min_oom_rule") == "nested-plan" for r in auto.limits),
        failures_implied_by_line=sum(r.get("min_oom_rule") == "memory-line" for r in auto.limits),
        confirming_trials=confirming, exact_limits=sum(bool(r.get("exact")) for r in auto.limits),
        not_timed_predicted_slower=seeding.get("not_timed_predicted_slower"), time_error=seeding.get("time_error"))
    floor = oracle(grid)
    row("oracle", floor["trials"], None, {(r["precision"], r["segments"]): r["max_batch_size"] for r in grid.limits}
        if floor["limits_equal_grid"] else {}, best, "none", **{k: v for k, v in floor.items() if k != "trials"})
    for method, found in finder_rows(grid, budget, grid.headroom).items():
        row(method, found["trials"], found["trial_seconds"], found["limits"], found["recommendation"], "grid trial seconds")
    memory_model = auto.to_dict()["memory_model"]
    real = (real_finders(spec, args, grid_limits, memory_model, max(grid.search["space"]["batch_sizes"]), folder)
            if name in args.real_finders.split(",") else [])
    grid.to_json(os.path.join(args.out, f"grid-{name}-{grid.environment['device_type']}.json"))
    return {
        "model": spec,
        "parameter_count": grid.workload["parameter_count"],
        "chain_length": (grid.workload["chain"] or {}).get("length"),
        "space": grid.search["space"],
        "budget_bytes": budget,
        "grid_limits": [{"precision": p, "segments": s, "max_batch_size": b} for (p, s), b in grid_limits.items()],
        "auto_limits": auto.limits,
        "auto_trials": [{"config": str(m.config), "status": m.status, "figures": m.figures, "memory_from": m.memory_from,
                         "timings": m.timings, "samples_per_s": m.samples_per_s} for m in auto.trials],
        "grid_recommendation": None if best is None else str(best.config),
        "auto_recommendation": None if auto.recommendation is None else str(auto.recommendation.config),
        "memory_model": memory_model,
        "methods": rows,
        "real_finders": real,
        "auto_vs_oracle_trials": round(auto.search["n_run"] / floor["trials"], 3),
        "auto_vs_grid_wall": round(auto.search["wall_s"] / grid.search["wall_s"], 3),
    }


DEFAULT_RUN = ["--model", "autotune.examples:TinyGPT", "--data", "autotune.examples:token_dataset"]


def default_run(args, folder):
    """The default space on TinyGPT with data, end to end (search, probe, library comparison) from an empty store."""
    flags = [*DEFAULT_RUN, "--device", args.device, "--budget", args.budget]
    out = os.path.join(folder, "default.json")
    print(f"default run: python -m autotune {' '.join(flags)} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autotune", *flags, "--storage", f"sqlite:///{folder}/default.db",
                           "--out", out], capture_output=True, text=True)
    result = {"command": "python -m autotune " + " ".join(flags), "returncode": proc.returncode,
              "wall_s": round(time.monotonic() - started, 1)}
    if proc.returncode != 0:
        return {**result, "error": proc.stderr.strip().splitlines()[-1:]}
    report = autotune.load(out)
    rec = report.recommendation
    return {**result, "trials": report.search["n_run"], "configurations": len(report.trials),
            "search_wall_s": report.search["wall_s"], "space_size": len(SearchSpace.from_dict(report.search["space"])),
            "recommendation": None if rec is None else str(rec.config),
            "probe": [{"config": str(p.config), "accepted": p.accepted, "wall_s": round(p.wall_s, 1)}
                      for p in report.probe or ()]}


def _by_prediction(model, rule: str) -> int:
    """How many of auto's limits have a side implied by a confirmed prediction (``min_oom_rule`` or ``max_rule``)."""
    return sum(r.get(rule) == "prediction" for r in model.get("auto_limits", ()))


def markdown(data) -> str:
    env = data["environment"]
    lines = [f"# Search efficiency ({env['device_name']}, torch {env['torch_version']}, {env.get('torch_threads', '')} threads)",
             "", f"Command: `{data['command']}`", ""]
    for model in data["models"]:
        lines += [f"## {model['model']} ({model['parameter_count']:,} parameters, chain of {model['chain_length']}), "
                  f"budget {format_bytes(model['budget_bytes'])}", "",
                  f"grid recommendation: {model['grid_recommendation']}; auto: {model['auto_recommendation']}", "",
                  "| method | trials | share of grid | seconds | exact limits | recommendation | throughput vs grid's best |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        for r in model["methods"]:
            secs = "-" if r["seconds"] is None else f"{r['seconds']}" + (" (grid's trials)" if r["seconds_kind"] != "wall" else "")
            lines.append(f"| {r['method']} | {r['trials']} | {r['trials_share_of_grid']:.0%} | {secs} | "
                         f"{r['plans_exact']}/{r['plans']} | {r['recommendation']} | {r['throughput_vs_grid_best']} |")
        auto = next((r for r in model["methods"] if r["method"] == "auto"), None)
        if auto and "memory_trials" in auto:
            grid = model["methods"][0]
            confirming = auto.get("confirming_trials", 0)
            lines += ["", f"auto: {auto['memory_trials']} of its {auto['trials']} trials were memory trials (metered, not "
                      f"timed), {auto['timed_after_memory_trial']} of them timed later"
                      + (f", {confirming} of them after the search, confirming the recommended variant's predicted "
                         f"exact limit" if confirming else "")
                      + f"; {auto['timed_again']} near ties "
                      f"timed again; {auto['failures_implied']} limits' failing side implied by a plan that needs no "
                      f"more memory, {auto.get('failures_implied_by_line', 0)} by the plan's own memory line and "
                      f"{_by_prediction(model, 'min_oom_rule')} by its prediction; "
                      f"{_by_prediction(model, 'max_rule')} largest fits implied by the plan's prediction (the "
                      f"predictions of a precision standing on a trial within 1% of its own prediction)"
                      + (f"; {auto['exact_limits']} of {auto['plans']} limits exact (the largest batch that fits and "
                         f"the next, between the space's sizes or above its top)" if "exact_limits" in auto else "")
                      + (f"; {auto['not_timed_predicted_slower']} configurations within the budget not timed, their "
                         f"predicted steps losing by more than {2 * auto['time_error']:.0%}"
                         if auto.get("not_timed_predicted_slower") is not None else "")
                      + f". Wall time {auto['seconds'] / grid['seconds']:.0%} of the grid's, its predictions' seconds "
                      f"included."]
        floor = next((r for r in model["methods"] if r["method"] == "oracle"), None)
        if auto and floor:
            lines += ["", f"oracle: the fewest trials that know every limit (computed from the grid's trials: each plan's "
                      f"largest fitting batch, the grid's recommendation timed, and each of the {floor['failing_sides']} "
                      f"failing sides measured unless implied, {floor['implied_by_line']} by the memory line through the "
                      f"state ({floor['state_source']}) and {floor['implied_by_plan']} by a nested plan's measured failure): "
                      f"{floor['trials']} trials. auto ran {auto['trials'] / floor['trials']:.2f}x the oracle's trials."]
        if model["real_finders"]:
            if data.get("real_finders_command"):
                lines += ["", f"Real finders rerun with `{data['real_finders_command']}`."]
            lines += ["", "| real finder | precision | found batch | grid's largest (space) | memory line's largest | tries | wall s |",
                      "|---|---|---:|---:|---:|---:|---:|"]
            for r in model["real_finders"]:
                tries = r.get("trials") if r.get("trials") is not None else r.get("steps", "-")
                lines.append(f"| {r['method']} | {r['precision']} | {r.get('found', r.get('error'))} | {r['grid_max_batch_size']} | "
                             f"{r.get('model_max_batch_size', '-')} | {tries} | {r.get('wall_s', '-')} |")
        lines.append("")
    run = data.get("default_run")
    if run:
        lines += ["## The default space with data, end to end", "", f"`{run['command']}` (every other flag at its default), "
                  f"from an empty store: exit {run['returncode']} after {run['wall_s']} s"]
        if run["returncode"] == 0:
            lines[-1] += (f"; {run['trials']} trials ({run['configurations']} configurations of {run['space_size']}) in "
                          f"{run['search_wall_s']:.0f} s of search, then the probe of {len(run['probe'])} candidates "
                          f"and the library comparison; recommendation {run['recommendation']}.")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="TinyGPT,ResNetish")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--batch-sizes", default="1..256")
    parser.add_argument("--measure-steps", type=int, default=5)
    parser.add_argument("--trial-timeout", type=float, default=300.0)
    parser.add_argument("--real-finders", default="TinyGPT", metavar="MODELS",
                        help="models to run the real lightning and accelerate finders on ('' for none)")
    parser.add_argument("--real-finders-only", action="store_true",
                        help="rerun only the real finders, into the existing results JSON (its grid limits and memory lines)")
    parser.add_argument("--no-default-run", dest="default_run", action="store_false",
                        help="skip the default-space TinyGPT run with --data, timed end to end")
    parser.add_argument("--replay", action="store_true",
                        help="replay auto on the grid reports in --out instead (seconds, no training): trials against the oracle")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    if args.replay:
        for name in (n for n in args.models.split(",") if n):
            grid = autotune.load(os.path.join(args.out, f"grid-{name}-{torch.device(args.device).type}.json"))
            print(name, replay_summary(grid))
            print(name, "seeded by predictions:", replay_summary(grid, predicted=True))
        return
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"search_efficiency-{torch.device(args.device).type}")
    command = "python benchmarks/search_efficiency.py " + " ".join(sys.argv[1:])
    started = time.monotonic()
    if args.real_finders_only:
        with open(stem + ".json") as f:
            data = json.load(f)
        with tempfile.TemporaryDirectory() as folder:
            for model in data["models"]:
                if model["model"] in [MODELS[name] for name in args.real_finders.split(",") if name]:
                    limits = {(r["precision"], r["segments"]): r["max_batch_size"] for r in model["grid_limits"]}
                    model["real_finders"] = real_finders(model["model"], args, limits, model["memory_model"],
                                                         max(model["space"]["batch_sizes"]), folder)
        data["real_finders_command"], data["real_finders_wall_s"] = command, round(time.monotonic() - started, 1)
    else:
        with tempfile.TemporaryDirectory() as folder:
            models = [run_model(name, args, folder) for name in args.models.split(",") if name]
            run = default_run(args, folder) if args.default_run else None
        data = {"benchmark": "search_efficiency", "command": command,
                "environment": backend_for(torch.device(args.device)).environment(), "wall_s": round(time.monotonic() - started, 1),
                "models": models, "default_run": run}
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=2, default=str)
    with open(stem + ".md", "w") as f:
        f.write(markdown(data) + "\n")
    print(markdown(data))


if __name__ == "__main__":
    main()

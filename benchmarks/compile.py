"""Compiled training, measured: every configuration eager and under torch.compile, one search per bundled model.

    python benchmarks/compile.py [--out results] [--models TinyGPT,ResNetish] [--rounds 20] [--steps 2]
    python benchmarks/compile.py --markdown-only   # results/compile-cpu.md again, from results/compile-cpu.json

1. **The searches.** Per bundled model (TinyGPT with n_layer 4, n_embd 128, block_size 64: the issue's "done when"
   configuration; ResNetish at its default size, whose steps take a fraction of a second), one
   ``autotune.tune(model, budget="1GiB", precisions="fp32,bf16", segments="0,all", batch_sizes="8,16,32",
   strategy="grid", compile="none,default", probe=False, compare_library=False)``, each in a fresh process whose
   inductor cache starts empty: ``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` (inductor keeps its precompiled headers
   under the temporary directory, whatever the cache directory) point into a temporary directory this script makes,
   one per model, so that compile seconds are a cold compile's. The reports are ``results/compile-<model>-cpu.json``.
   From them: each configuration's peak and speed eager and compiled (each eager configuration measured again by
   the allocator meter, so that one meter reads both), the limits under 1 GiB and under a smaller budget computed
   from the same trials (``report.for_budget``), compile seconds, graphs compiled per variant (the issue's bar is
   2: asserted after the files are written, so that a run past it leaves its figures), graph breaks, and the plan
   checks under compile.
2. **An independent check of the compiled peaks** (TinyGPT, each compiled variant at batch 16), in a fresh process
   per configuration, without the allocator meter's code: torch's public profiler (``torch.profiler.profile(
   activities=[CPU], profile_memory=True)``), its Chrome trace's ``[memory]`` events summed in time order (a free
   counts for a block allocated inside the profiled region, found by its address). Two regions: (a) the trial's own
   (a fresh copy of the model built, prepared and compiled, its optimizer and state, the batch, two steps), with the
   compiles before it arranged so that it compiles as many graphs as the search's trial did; (b) one steady step
   after them, plus the bytes of the unique storages alive before it (parameters, buffers, optimizer state, batch).
   And (c), another source: glibc's ``mallinfo2()`` (bytes in use in every arena, plus mmapped chunks), sampled by a
   thread during three more steady steps, its highest rise over their start plus the same storages.
3. **Dynamic shapes against static.** The compiled variant the recommendation is (else the fastest compiled one), at
   its largest batch that fits: its step time compiled as the search compiled it (a trial at the space's first
   batch size compiles the graph, its batch dimension marked dynamic; this batch reuses it) against
   ``torch.compile(model, dynamic=False)`` at that size alone, and eager, each in its own worker process, timed in
   interleaved rounds.

Writes ``results/compile-<device>.json`` (the command, the environment, the date, the load average, every figure) and
``.md`` (the tables and the sentences under them, from the JSON).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # name: (spec, model_kwargs)
    "TinyGPT": ("autotune.examples:TinyGPT", {"n_layer": 4, "n_embd": 128, "block_size": 64}),
    "ResNetish": ("autotune.examples:ResNetish", None),
}
SEARCH = dict(device="cpu", budget="1GiB", precisions="fp32,bf16", segments="0,all", batch_sizes="8,16,32",
              strategy="grid", compile="none,default", probe=False, compare_library=False,
              static_compile=False)  # part 3 times the recommendation static, interleaved in workers of their own
MODE = "default"  # the compile mode searched beside eager
CHECK_BATCH = 16  # the batch size of the independent check
FIRST_BATCH = 8  # the space's first batch size: the search compiles each variant's graph there
MALLOC_STEPS = 3  # steady steps sampled by mallinfo2 (a sampler can miss a short peak: the highest of three)
MARK = "@@"  # a worker's answers on stdout start with this (anything else a library prints there is skipped)


# -- the parts that run in fresh processes -------------------------------------------------------------------------


def part_search(name: str, to: str) -> None:
    """One search (SEARCH) of model ``name`` in this process, its trial store a fresh one; its report written to ``to``."""
    import autotune

    spec, kwargs = MODELS[name]
    started = time.monotonic()
    store = os.path.join(os.environ["TMPDIR"], f"{name}.db")  # the scratch directory's: a new store
    report = autotune.tune(spec, model_kwargs=kwargs, storage=f"sqlite:///{store}", **SEARCH)
    report.to_json(to)
    print(f"{name}: {len(report.trials)} trials in {time.monotonic() - started:.0f} s", file=sys.stderr)


def _workload(name: str):
    """The model's workload with its chain of blocks, as the search finds it (plan ``all``: every block)."""
    from autotune.plans.checkpointing import find_chain
    from autotune.training.workload import Workload

    spec, kwargs = MODELS[name]
    workload = Workload.from_specs(spec, model_kwargs=kwargs)
    return workload.with_chain(find_chain(workload.build_model(seed=0)))


def _trainer(workload, precision: str, plan: str, batch: int, compile_mode: str):
    """A trial's training state (autotune's Trainer: the model copied, prepared and compiled, AdamW primed) and batch."""
    import torch

    from autotune.records import Config, TrialSettings
    from autotune.training.trainer import Trainer

    settings = TrialSettings()  # the search's: seed 0, lr, guard rails
    trainer = Trainer(workload, Config(precision, plan, batch, compile_mode), torch.device("cpu"), lr=settings.lr,
                      seed=settings.seed, guard=settings.guard)
    trainer.build()
    return trainer, workload.make_batch(trainer.module, batch)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _profiled_peak(run) -> dict:
    """``run()`` under torch's public profiler (CPU, memory): the peak of its memory events' running sum, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    with tempfile.TemporaryDirectory() as where:
        prof.export_chrome_trace(os.path.join(where, "trace.json"))
        events = json.loads(Path(where, "trace.json").read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0),
                    key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    blocks, live, peak = {}, 0, 0
    for e in memory:
        nbytes, address = e["args"]["Bytes"], e["args"]["Addr"]
        if nbytes > 0:
            blocks[address] = nbytes
            live += nbytes
            peak = max(peak, live)
        else:  # a free counts only for a block the region allocated
            live -= blocks.pop(address, 0)
    return {"peak_bytes": peak, "events": len(memory),
            "c10_total_allocated_max": max((e["args"].get("Total Allocated", 0) for e in memory), default=0)}


def _alive_bytes(trainer, batch) -> int:
    """Bytes of the unique storages alive between steps: parameters, buffers, optimizer state, the batch."""
    import torch

    tensors = [*trainer.module.parameters(), *trainer.module.buffers(), *[p.grad for p in trainer.module.parameters()]]
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values()] + list(trainer.ballast)
    tensors += list(batch) if isinstance(batch, (tuple, list)) else list(batch.values()) if isinstance(batch, dict) \
        else [batch]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    return sum(storages.values())


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


def _malloc_rise(run) -> dict:
    """``run()`` while a thread samples glibc's ``mallinfo2()``: the most bytes in use above the start, in bytes."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # allocated from the arenas, and mmapped chunks

    gc.collect()
    start, highest, samples, done = in_use(), [0], [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            highest[0] = max(highest[0], in_use())
            samples[0] += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the sampler runs whenever the step holds no GIL, and between its Python lines
    thread = threading.Thread(target=sample, daemon=True)
    try:
        thread.start()
        run()
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    return {"rise_bytes": max(0, highest[0] - start), "samples": samples[0]}


def part_peak(name: str, precision: str, plan: str, batch: int, before: list[int], to: str) -> None:
    """The independent check of one compiled configuration (see the module's docstring, 2); JSON written to ``to``."""
    from autotune.training.compiled import compiling

    workload = _workload(name)
    workload.warm(0)  # as a trial: the model built once, outside the region; trials start from copies
    out: dict = {"precision": precision, "plan": plan, "batch_size": batch, "compiled_before": before}
    with compiling():
        for size in before:  # the graphs the search's earlier trials left in its process
            trainer, b = _trainer(workload, precision, plan, size, MODE)
            trainer.step(b)
            trainer.release()
        held: dict = {}
        graphs = _graphs()

        def trial_region() -> None:  # what a compiled trial's allocator meter measures: build, batch, two steps
            held["trainer"], held["batch"] = _trainer(workload, precision, plan, batch, MODE)
            held["trainer"].step(held["batch"])
            held["trainer"].step(held["batch"])

        out["trial_region"] = {**_profiled_peak(trial_region), "graphs_compiled": _graphs() - graphs}
        trainer, b = held["trainer"], held["batch"]
        gc.collect()
        alive = _alive_bytes(trainer, b)
        steady = _profiled_peak(lambda: trainer.step(b))
        rise = _malloc_rise(lambda: [trainer.step(b) for _ in range(MALLOC_STEPS)])
    out["alive_bytes"] = alive
    out["steady_step"] = {**steady, "peak_bytes": alive + steady["peak_bytes"]}
    out["mallinfo2"] = {**rise, "peak_bytes": alive + rise["rise_bytes"]}
    out["plan_applied"] = trainer.plan  # the search's trial records the same
    Path(to).write_text(json.dumps(out, indent=2))


def part_eager_allocator(name: str, to: str) -> None:
    """Every eager configuration of the search's space measured by the allocator meter too (a memory trial each):
    compiled peaks against eager ones read by the same meter; JSON written to ``to``."""
    import torch

    from autotune.execution.trial import run_trial
    from autotune.meters import AllocatorMeter
    from autotune.records import Config, TrialSettings

    workload, peaks = _workload(name), {}
    for precision in SEARCH["precisions"].split(","):
        for plan in SEARCH["segments"].split(","):
            for batch in map(int, SEARCH["batch_sizes"].split(",")):
                m = run_trial(workload, Config(precision, plan, batch), device=torch.device("cpu"),
                              meter=AllocatorMeter(), settings=TrialSettings(), timed=False)
                peaks[f"{precision}/{plan}/{batch}"] = m.peak_bytes if m.status == "ok" else None
    Path(to).write_text(json.dumps(peaks, indent=2))


def part_speed(name: str, precision: str, plan: str, batch: int, how: str) -> None:
    """A timing worker: ``how`` is eager, dynamic (a trial at the space's first batch size before, as in the search:
    its graph, the batch dimension dynamic, is the one this batch reuses) or static (``torch.compile(dynamic=False)``
    at this batch alone); answers ``N`` on stdin with N timed steps' seconds on stdout."""
    import torch

    from autotune.training.compiled import compiling

    workload = _workload(name)
    workload.warm(0)
    with compiling():
        if how == "dynamic":  # the search's first trial of the variant: it compiles the graph every later one reuses
            first, b = _trainer(workload, precision, plan, FIRST_BATCH, MODE)
            first.step(b)
            first.release()
        trainer, b = _trainer(workload, precision, plan, batch, MODE if how == "dynamic" else "none")
        if how == "static":
            trainer.run.model = torch.compile(trainer.run.model, dynamic=False)
        graphs, began = _graphs(), time.monotonic()
        trainer.step(b)
        first_s = time.monotonic() - began
        trainer.step(b)
        print(MARK + json.dumps({"graphs_at_batch": _graphs() - graphs, "first_step_s": round(first_s, 3)}), flush=True)
        for line in sys.stdin:
            times = [trainer.timed_step(b) for _ in range(int(line))]
            print(MARK + json.dumps(times), flush=True)


# -- the driver: fresh processes, and what their results say ------------------------------------------------------


def _child(args: list[str], env: dict, **kwargs) -> subprocess.Popen:
    """This script in a fresh process, in the scratch directory (nothing lands in the checkout)."""
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], env=env, cwd=env["TMPDIR"],
                            **kwargs)


def _cache_env(where: Path) -> dict:
    """The environment of a process whose inductor cache (and precompiled headers) lives under ``where``."""
    (where / "inductor").mkdir(parents=True, exist_ok=True)
    (where / "tmp").mkdir(exist_ok=True)
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(where / "inductor"), TMPDIR=str(where / "tmp"),
                TORCH_CPP_LOG_LEVEL="ERROR", KINETO_LOG_LEVEL="6",  # c10's and Kineto's lines on stderr: off
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _answer(worker: subprocess.Popen):
    for line in worker.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"a timing worker ended early (exit {worker.wait()})")


def dynamic_vs_static(name: str, report, env: dict, rounds: int, steps: int) -> dict:
    """Eager, compiled as searched (dynamic) and compiled static at one size, timed side by side (interleaved)."""
    rec, limits = report.recommendation, {(r["precision"], r["segments"], r["compile"]): r for r in report.limits}
    compiled = [m for m in report.trials if m.config.compiled and m.status == "ok" and m.fits(report.budget_bytes)]
    best = rec if rec is not None and rec.config.compiled else max(compiled, key=lambda m: m.samples_per_s)
    variant = best.config.variant
    batch = limits[(variant.precision, str(variant.plan), variant.compile)]["max_batch_size"]
    eager = rec.config if rec is not None and not rec.config.compiled else variant.at(batch)
    runs = {"eager": (eager.precision, str(eager.plan), eager.batch_size), "dynamic": (variant.precision,
            str(variant.plan), batch), "static": (variant.precision, str(variant.plan), batch)}
    workers, ready = {}, {}
    for how, (precision, plan, size) in runs.items():  # one at a time: each compiles with the machine to itself
        workers[how] = _child(["--part", "speed", "--model", name, "--precision", precision, "--plan", plan,
                               "--batch", str(size), "--how", how], env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
        ready[how] = _answer(workers[how])
    times: dict = {how: [] for how in runs}
    for r in range(rounds):  # each round starts with another worker: drift in the machine's load spreads over all
        order = list(runs)[r % 3:] + list(runs)[:r % 3]
        for how in order:
            workers[how].stdin.write(f"{steps}\n")
            workers[how].stdin.flush()
            times[how].append(_answer(workers[how]))
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    out = {how: {"precision": p, "plan": s, "batch_size": b, **ready[how], "round_medians_s":
                 [statistics.median(t) for t in times[how]], "steps_s": times[how]} for how, (p, s, b) in runs.items()}
    for how in out:
        out[how]["step_s"] = statistics.median(out[how]["round_medians_s"])
        out[how]["samples_per_s"] = out[how]["batch_size"] / out[how]["step_s"]
        out[how]["fastest_step_s"] = min(t for r in times[how] for t in r)  # the least disturbed by other jobs
    out["recommendation"] = rec.config.to_dict() if rec else None
    out["static_vs_dynamic"] = out["static"]["step_s"] / out["dynamic"]["step_s"]
    out["static_vs_dynamic_fastest"] = out["static"]["fastest_step_s"] / out["dynamic"]["fastest_step_s"]
    out["rounds"], out["steps_per_round"] = rounds, steps
    return out


def independent_checks(name: str, report, env: dict, scratch: Path) -> list[dict]:
    """Part 2 for every compiled variant at CHECK_BATCH, each in a fresh process (the search's cache: warm)."""
    rows = []
    for m in report.trials:
        if not (m.config.compiled and m.batch_size == CHECK_BATCH and m.status == "ok"):
            continue
        before = {0: [8, CHECK_BATCH], 1: [8]}.get(m.compiles, [])  # so that the region compiles what the trial did
        to = scratch / f"peak-{m.config.precision}-{m.config.plan}.json"
        done = _child(["--part", "peak", "--model", name, "--precision", m.config.precision, "--plan",
                       str(m.config.plan), "--batch", str(CHECK_BATCH), "--before", ",".join(map(str, before)),
                       "--to", str(to)], env).wait()
        if done != 0:
            raise SystemExit(f"the independent check of {m.config} failed (exit {done})")
        row = json.loads(to.read_text())
        row["search_peak_bytes"], row["search_compiles"] = m.peak_bytes, m.compiles
        assert row["plan_applied"] == m.plan, (row["plan_applied"], m.plan)  # the same blocks recomputed
        for method in ("trial_region", "steady_step", "mallinfo2"):
            row[method]["vs_search"] = row[method]["peak_bytes"] / m.peak_bytes
        rows.append(row)
        print(f"  {m.config}: the search's {m.peak_bytes} B; profiler {row['trial_region']['peak_bytes']} B "
              f"({row['trial_region']['vs_search']:.4f}), steady {row['steady_step']['vs_search']:.4f}, "
              f"mallinfo2 {row['mallinfo2']['vs_search']:.4f}", file=sys.stderr, flush=True)
    return rows


def _trial(m) -> dict | None:
    if m is None:
        return None
    data = m.to_dict()
    return {k: data[k] for k in ("status", "peak_bytes", "memory_source", "step_s", "samples_per_s", "compile_s",
                                 "compiles", "graph_breaks", "setup_s", "wall_s")}


def smaller_budget(report) -> int:
    """The smaller budget the limits bind under: the median peak at batch 16 (eager and compiled), whole MiB up."""
    peaks = [m.peak_bytes for m in report.trials if m.batch_size == 16 and m.peak_bytes and m.status == "ok"]
    return -(-int(statistics.median(peaks)) // 2**20) * 2**20


def summarise(name: str, report, search_s: float) -> dict:
    """Per configuration eager against compiled; per variant limits, compile figures and plan checks."""
    space = report.search["space"]
    trials = {(m.config.precision, str(m.config.plan), m.batch_size, m.config.compile): m for m in report.trials}
    configurations = [{"precision": p, "plan": s, "batch_size": b, "eager": _trial(trials.get((p, s, b, "none"))),
                       "compiled": _trial(trials.get((p, s, b, MODE)))}
                      for p in space["precisions"] for s in space["segments"] for b in space["batch_sizes"]]
    small = smaller_budget(report)
    limits = {(r["precision"], str(r["segments"]), r["compile"]): r for r in report.limits}
    small_limits = {(r["precision"], str(r["segments"]), r["compile"]): r for r in report.for_budget(small)["limits"]}
    checks = {(str(c.plan), c.compile): c.to_dict() for c in report.plan_checks}
    variants = []
    for p in space["precisions"]:
        for s in space["segments"]:
            compiled = [m for m in report.trials
                        if (m.config.precision, str(m.config.plan), m.config.compile) == (p, s, MODE)]
            by_batch = {m.batch_size: m.compiles for m in compiled}
            check = (checks.get((s, MODE)) or {}).get("compiles")
            if p == "fp32" and check is not None:  # the checks run in fp32: the variant's trials reuse their graph
                by_batch = {"check": check, **by_batch}
            compiles = sum(n or 0 for n in by_batch.values())
            print(f"{name} {p}/{s}/compiled: {compiles} graphs compiled over its {len(compiled)} trials "
                  f"({[(m.batch_size, m.compiles) for m in compiled]}){'' if compiles <= 2 else ', more than 2'}",
                  file=sys.stderr, flush=True)
            variants.append({
                "precision": p, "plan": s, "compiles": compiles,
                "compiles_by_batch": by_batch,
                "compile_s": sum(m.compile_s or 0.0 for m in compiled),
                "compile_s_by_batch": {m.batch_size: m.compile_s for m in compiled},
                "graph_breaks": max((m.graph_breaks or 0 for m in compiled), default=None),
                "limits": {c: _limit(limits.get((p, s, c))) for c in ("none", MODE)},
                "smaller_budget_limits": {c: _limit(small_limits.get((p, s, c))) for c in ("none", MODE)},
                "check_eager": checks.get((s, "none")), "check_compiled": checks.get((s, MODE))})
    rec = report.recommendation
    return {"name": name, "model": MODELS[name][0], "model_kwargs": MODELS[name][1], "report": f"compile-{name}-cpu.json",
            "parameters": report.workload.get("parameter_count"), "search_s": round(search_s, 1),
            "search_wall_s": report.search.get("wall_s"), "n_trials": len(report.trials),
            "trials_wall_s": {c: round(sum(m.wall_s for m in report.trials if m.config.compile == c), 1)
                              for c in ("none", MODE)},
            "memory_meter": report.search.get("memory_meter"), "budget_bytes": report.budget_bytes,
            "smaller_budget_bytes": small, "recommendation": _recommended(rec),
            "configurations": configurations, "variants": variants}


def _limit(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {k: row.get(k) for k in ("max_batch_size", "min_oom_batch_size", "min_oom_rule", "bracketed")}


def _recommended(m) -> dict | None:
    return None if m is None else {**m.config.to_dict(), "samples_per_s": m.samples_per_s, "peak_bytes": m.peak_bytes}


# -- the Markdown, from the JSON ------------------------------------------------------------------------------------


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def _speed(t: dict | None) -> str:
    return "-" if not t or t["samples_per_s"] is None else f"{t['step_s']:.3f} s, {t['samples_per_s']:.1f}/s"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.3f}"


def configuration_table(model: dict) -> list[str]:
    lines = ["| precision | plan | batch | eager peak | compiled peak | compiled / eager | eager peak, allocator meter | "
             "compiled / eager, allocator meter both | eager step, samples/s | compiled step, samples/s | "
             "compiled / eager samples/s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in model["configurations"]:
        e, c, a = r["eager"] or {}, r["compiled"] or {}, r.get("eager_allocator_peak_bytes")
        lines.append(f"| {r['precision']} | `{r['plan']}` | {r['batch_size']} | {_mib(e.get('peak_bytes'))} | "
                     f"{_mib(c.get('peak_bytes'))} | {_ratio(c.get('peak_bytes'), e.get('peak_bytes'))} | {_mib(a)} | "
                     f"{_ratio(c.get('peak_bytes'), a)} | {_speed(e)} | "
                     f"{_speed(c)} | {_ratio(c.get('samples_per_s'), e.get('samples_per_s'))} |")
    return lines


def _check(check: dict | None) -> str:
    if check is None:
        return "-"
    diff = "" if check.get("compile_diff") is None else f"compile_diff {check['compile_diff']:.3g}, "
    worst = f" at `{check['worst']}`" if check.get("worst") else ""
    return (f"{check['status']} ({diff}max rel. diff {check['max_rel_diff']:.3g}{worst}, tolerance "
            f"{check['tolerance']:.3g})"
            if check.get("max_rel_diff") is not None else f"{check['status']} ({check.get('error')})")


def _lim(row: dict | None) -> str:
    if row is None:
        return "-"
    return "none" if row["max_batch_size"] is None else str(row["max_batch_size"])


def variant_table(model: dict) -> list[str]:
    small = _mib(model["smaller_budget_bytes"])
    lines = [f"| precision | plan | largest batch, 1 GiB: eager / compiled | under {small}: eager / compiled | "
             "compile s (by batch) | graphs compiled (the fp32 plan check's, by batch) | graph breaks | plan check eager | "
             "plan check compiled |", "|---|---|---:|---:|---|---|---:|---|---|"]
    for v in model["variants"]:
        by_batch = ", ".join(f"{b}: {s:.1f}" for b, s in v["compile_s_by_batch"].items() if s is not None)
        graphs = ", ".join(f"{b}: {n}" for b, n in v["compiles_by_batch"].items())
        lines.append(f"| {v['precision']} | `{v['plan']}` | {_lim(v['limits']['none'])} / {_lim(v['limits'][MODE])} | "
                     f"{_lim(v['smaller_budget_limits']['none'])} / {_lim(v['smaller_budget_limits'][MODE])} | "
                     f"{v['compile_s']:.1f} ({by_batch}) | {v['compiles']} ({graphs}) | {v['graph_breaks']} | "
                     f"{_check(v['check_eager'])} | {_check(v['check_compiled'])} |")
    return lines


def independent_table(rows: list[dict]) -> list[str]:
    lines = ["| precision | plan | batch | the search's peak (allocator meter) | graphs compiled: the search's trial / "
             "region (a) | (a) profiler, the trial's region | (a) / search | (b) profiler, a steady step + storages | "
             "(b) / search | (c) mallinfo2, a steady step + storages | (c) / search |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        a, b, c = r["trial_region"], r["steady_step"], r["mallinfo2"]
        lines.append(f"| {r['precision']} | `{r['plan']}` | {r['batch_size']} | {_mib(r['search_peak_bytes'])} | "
                     f"{r['search_compiles']} / {a['graphs_compiled']} | {_mib(a['peak_bytes'])} | {a['vs_search']:.4f} | "
                     f"{_mib(b['peak_bytes'])} | {b['vs_search']:.4f} | {_mib(c['peak_bytes'])} | {c['vs_search']:.4f} |")
    return lines


def speed_table(d: dict) -> list[str]:
    names = {"eager": "eager", "dynamic": "compiled as the search compiled it (dynamic batch)",
             "static": "compiled static at this size (`dynamic=False`)"}
    lines = ["| run | configuration | graphs compiled at this batch (its first step) | step (median of round medians) | "
             "samples/s | vs compiled dynamic | fastest step | vs compiled dynamic's fastest |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for how in ("eager", "dynamic", "static"):
        r = d[how]
        lines.append(f"| {names[how]} | {r['precision']} `{r['plan']}` batch {r['batch_size']} | {r['graphs_at_batch']} "
                     f"({r['first_step_s']:.1f} s) | "
                     f"{r['step_s']:.4f} s | {r['samples_per_s']:.1f} | {r['step_s'] / d['dynamic']['step_s']:.3f} | "
                     f"{r['fastest_step_s']:.4f} s | {r['fastest_step_s'] / d['dynamic']['fastest_step_s']:.3f} |")
    return lines


def findings(model: dict) -> list[str]:
    """The sentences under a model's tables: every figure from its JSON."""
    variants = model["variants"]
    differ = [v for v in variants if _lim(v["limits"]["none"]) != _lim(v["limits"][MODE])]
    small_differ = [f"{v['precision']} `{v['plan']}` ({_lim(v['smaller_budget_limits']['none'])} eager, "
                    f"{_lim(v['smaller_budget_limits'][MODE])} compiled)" for v in variants
                    if _lim(v["smaller_budget_limits"]["none"]) != _lim(v["smaller_budget_limits"][MODE])]
    lines = [_peak_sentence(model),
             f"- **Limits**: under 1 GiB the largest batch that fits differs eager and compiled in {len(differ)} of "
             f"{len(variants)} variants; under {_mib(model['smaller_budget_bytes'])} (the median peak at batch 16, "
             f"computed from the same trials) in {len(small_differ)}" + (f": {', '.join(small_differ)}." if small_differ
                                                                          else "."),
             f"- **Compiling**: {sum(v['compile_s'] for v in variants):.1f} s of compile in "
             f"{model['search_wall_s']:.0f} s of search (cold cache); at most "
             f"{_graphs_word(max(v['compiles'] for v in variants))} compiled per variant" + _over_two(variants)
             + f"; {sum(v['graph_breaks'] or 0 for v in variants)} graph breaks."]
    if model.get("independent"):
        lines.append(_independent_sentence(model["independent"]))
    if model.get("dynamic_vs_static"):
        lines.append(_speed_sentence(model["dynamic_vs_static"]))
    return lines


def _graphs_word(n: int) -> str:
    return f"{n} graph" if n == 1 else f"{n} graphs"


def _over_two(variants: list[dict]) -> str:
    over = [f"{v['precision']} `{v['plan']}` {v['compiles']} ({', '.join(str(n) for n in v['compiles_by_batch'].values())}"
            f" at {', '.join(str(b) for b in v['compiles_by_batch'])})" for v in variants if v["compiles"] > 2]
    return "" if not over else f", more than the issue's 2 in {len(over)} variants: {'; '.join(over)}"


def _peak_sentence(model: dict) -> str:
    rows = [r for r in model["configurations"] if r["compiled"] and r["eager"] and r["compiled"]["peak_bytes"]]

    def span(eager) -> str:
        ratios = [(r["compiled"]["peak_bytes"] / eager(r), r) for r in rows if eager(r)]
        if not ratios:
            return "not measured"
        low, high = min(ratios, key=lambda x: x[0]), max(ratios, key=lambda x: x[0])
        above, far = sum(x > 1.0 for x, _ in ratios), sum(x > 1.01 for x, _ in ratios)
        return (f"{low[0]:.3f} ({_where(low[1])}) to {high[0]:.3f} ({_where(high[1])}), above eager in {above} of "
                f"{len(ratios)} configurations ({far} by more than 1%)")

    return (f"- **Peaks**, compiled against eager: {span(lambda r: r['eager']['peak_bytes'])}; with the eager ones "
            f"read by the allocator meter too, {span(lambda r: r.get('eager_allocator_peak_bytes'))}.")


def _where(r: dict) -> str:
    return f"{r['precision']} `{r['plan']}` batch {r['batch_size']}"


def _independent_sentence(rows: list[dict]) -> str:
    def span(method: str) -> str:
        values = [r[method]["vs_search"] for r in rows]
        return f"{min(values):.4f} to {max(values):.4f}"

    within = all(abs(r["trial_region"]["vs_search"] - 1) <= 0.05 for r in rows)
    return (f"- **The independent check** (batch {rows[0]['batch_size']}, {len(rows)} compiled variants): the profiler's "
            f"events over the trial's region give {span('trial_region')} times the search's peak "
            f"({'within' if within else 'not all within'} the issue's 5%); a steady step plus the storages alive "
            f"before it, {span('steady_step')}; mallinfo2 over {MALLOC_STEPS} steady steps, {span('mallinfo2')}.")


def _speed_sentence(d: dict) -> str:
    rec = d["recommendation"]
    said = "none" if rec is None else (f"{rec['precision']} `{rec['segments']}` batch {rec['batch_size']} "
                                       f"{'eager' if rec['compile'] == 'none' else 'compiled'}")
    against = "dynamic" if rec is not None and rec["compile"] != "none" else "eager"  # what the recommendation is
    by_median = d["static"]["step_s"] / d["static"]["batch_size"] < d[against]["step_s"] / d[against]["batch_size"]
    by_fastest = (d["static"]["fastest_step_s"] / d["static"]["batch_size"]
                  < d[against]["fastest_step_s"] / d[against]["batch_size"])
    verdict = ("faster" if by_median else "no faster") if by_median == by_fastest else \
        f"{'faster' if by_median else 'no faster'} by the medians and {'faster' if by_fastest else 'no faster'} by " \
        f"the fastest steps: undecided by this run"
    s, e = d["static"], d["eager"]
    return (f"- **Dynamic against static** ({d['rounds']} interleaved rounds of {d['steps_per_round']} steps, "
            f"{s['precision']} `{s['plan']}` batch {s['batch_size']}): the static compile's step takes "
            f"{d['static_vs_dynamic']:.3f} times the dynamic one's by the medians, {d['static_vs_dynamic_fastest']:.3f} "
            f"by the fastest steps ({s['step_s']:.4f} s against "
            f"{d['dynamic']['step_s']:.4f} s; eager {e['precision']} `{e['plan']}` batch {e['batch_size']}: "
            f"{e['step_s']:.4f} s, {e['samples_per_s']:.1f} samples/s against static's {s['samples_per_s']:.1f}). "
            f"Timed static, the recommendation ({said}) would be {verdict}.")


def markdown(data: dict) -> str:
    env, load = data["environment"], data["load_average"]
    busy = max(load["start"], load["end"]) > env["cpu_count"]  # more runnable processes than cores: other jobs
    lines = [f"# Compiled training, measured: eager against torch.compile ({env['device_name']}, torch "
             f"{env['torch_version']})", "",
             f"Command: `{data['command']}` ({data['wall_s'] / 60:.0f} min on {data['date']}; the machine's load average "
             f"{load['start']:.1f} at the start, {load['end']:.1f} at the end, on {env['cpu_count']} cores"
             + (", other jobs running: step times are noisy" if busy else "; step times of one run each")
             + f", ratios measured side by side are the ones to read). Per model one "
             f"search: budget 1 GiB, precisions fp32,bf16, plans `0`,`all`, batch sizes 8,16,32, grid, compile "
             f"`none,{MODE}`, no probe, no library comparison, no static re-timing of the recommendation (the "
             f"last table times it, interleaved); each in a fresh process with an empty inductor cache "
             f"(`TORCHINDUCTOR_CACHE_DIR` and `TMPDIR` in a new temporary directory): compile seconds are a cold "
             f"compile's. Eager peaks: the tensor meter, as the search measured them, and the allocator meter (each "
             f"eager configuration again, a memory trial in a fresh process after the search); compiled peaks: the "
             f"allocator meter (the CPU allocator's events). "
             f"Step time: the trial's median; compile seconds: a trial's first step beyond its second. Plan checks: "
             f"one per plan and compile mode, in fp32 (shown on both precisions' rows); `compile_diff` is the "
             f"compiled plan-free step against the eager one (recorded, no tolerance: compiled dropout draws other "
             f"masks than eager), and a compiled plan may differ from the compiled plan-free step by the tolerance, "
             f"1e-2 or 8 times the run-to-run noise where that is larger; differences relative to a value's largest "
             f"entry, or to 1e-3 of the model's largest gradient where that is larger.", ""]
    for m in data["models"]:
        kwargs = ", ".join(f"{k} {v}" for k, v in (m["model_kwargs"] or {}).items()) or "its default size"
        rec = m["recommendation"]
        lines += [f"## {m['name']} ({kwargs}; {m['parameters']:,} parameters)", "",
                  f"`results/{m['report']}`: {m['n_trials']} trials in {m['search_wall_s']:.0f} s of search "
                  f"({m['search_s']:.0f} s for its whole process, the plan checks' compiles included; trials "
                  f"eager {m['trials_wall_s']['none']:.0f} s, compiled {m['trials_wall_s'][MODE]:.0f} s). "
                  f"Recommendation: " + ("none" if rec is None else f"{rec['precision']} `{rec['segments']}` batch "
                  f"{rec['batch_size']}, {'eager' if rec['compile'] == 'none' else 'compiled'}, "
                  f"{rec['samples_per_s']:.1f} samples/s") + ".", "", *configuration_table(m), "",
                  *variant_table(m), ""]
        if m.get("independent"):
            lines += ["### The compiled peaks, measured another way", "", INDEPENDENT, "",
                      *independent_table(m["independent"]), ""]
        if m.get("dynamic_vs_static"):
            lines += ["### Dynamic shapes against static", "", SPEED, "", *speed_table(m["dynamic_vs_static"]), ""]
        lines += ["### What it shows", "", *findings(m), ""]
    return "\n".join(lines)


INDEPENDENT = (
    "Each compiled variant at the check's batch size, in a fresh process (the search's inductor cache: warm), without "
    "the allocator meter's code. (a) torch's public profiler (`torch.profiler.profile(activities=[CPU], "
    "profile_memory=True)`) over the region a compiled trial meters: a copy of the model built, prepared and "
    "compiled, AdamW and its primed state, the batch, two steps (graphs compiled in the region: as many as the "
    "search's trial, by the steps run before it); its Chrome trace's `[memory]` events summed in time order, a free "
    "counted for a block allocated in the region. Both count every block c10's CPU allocator handed out to this "
    "thread in the region and the model copied in it; neither counts what exists before (the template model) or "
    "what a library takes from malloc itself. (b) The same profiler over one steady step after (a), plus the bytes "
    "of the unique storages alive before it (parameters, buffers, optimizer state, batch). (c) glibc's `mallinfo2()` "
    "(bytes in use in every arena plus mmapped chunks: every thread's mallocs, Python's large objects and malloc's "
    "own rounding included), sampled by a thread during three more steady steps: its highest rise above their "
    "start plus the same storages; a sampler can miss a peak shorter than its interval.")
SPEED = (
    "The compiled variant the recommendation is (else the fastest compiled configuration that fits), at its largest "
    "batch under 1 GiB, three worker processes (the search's cache: warm): eager (the recommendation when it is "
    "eager, else the same configuration eager); compiled as the search compiled it (`torch.compile(model)` in a "
    f"trial at batch {FIRST_BATCH} first, its batch dimension marked dynamic as in every compiled trial: this batch "
    "reuses that graph, 0 graphs compiled at it); and `torch.compile(model, dynamic=False)` stepped at this size "
    "alone. Timed in interleaved rounds, each round starting with another worker: the median of the rounds' medians, "
    "and the fastest step (the one other jobs disturbed least). Samples/s compare configurations of different "
    "batch sizes.")


# -- the command ----------------------------------------------------------------------------------------------------


def run_model(name: str, out: Path, scratch: Path, args: argparse.Namespace) -> dict:
    """One model's search in a fresh process with a cold cache, then its checks against the search's warm cache."""
    import autotune

    env = _cache_env(scratch / name)
    report_path, load, started = out / f"compile-{name}-cpu.json", os.getloadavg()[0], time.monotonic()
    print(f"{name}: the search ...", file=sys.stderr, flush=True)
    if _child(["--part", "search", "--model", name, "--to", str(report_path.resolve())], env).wait() != 0:
        raise SystemExit(f"the search of {name} failed")
    report = autotune.load(report_path)
    model = {**summarise(name, report, time.monotonic() - started), "load_average_at_start": round(load, 2)}
    print(f"{name}: the eager configurations under the allocator meter ...", file=sys.stderr, flush=True)
    to = scratch / name / "eager-allocator.json"
    if _child(["--part", "eager-allocator", "--model", name, "--to", str(to)], env).wait() != 0:
        raise SystemExit(f"the eager configurations of {name} under the allocator meter failed")
    peaks = json.loads(to.read_text())
    for row in model["configurations"]:
        row["eager_allocator_peak_bytes"] = peaks[f"{row['precision']}/{row['plan']}/{row['batch_size']}"]
    if name in args.check_models.split(","):
        print(f"{name}: the independent check ...", file=sys.stderr, flush=True)
        model["independent"] = independent_checks(name, report, env, scratch / name)
    print(f"{name}: dynamic against static ...", file=sys.stderr, flush=True)
    model["dynamic_vs_static"] = dynamic_vs_static(name, report, env, args.rounds, args.steps)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results")
    parser.add_argument("--models", default="TinyGPT,ResNetish")
    parser.add_argument("--check-models", default="TinyGPT", help="the models whose compiled peaks are checked (2.)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds of the dynamic/static timing")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per worker and round")
    parser.add_argument("--markdown-only", action="store_true", help="write the .md from the committed .json, run nothing")
    for part in ("part", "model", "precision", "plan", "how", "to", "before"):  # a fresh process's part
        parser.add_argument(f"--{part}", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "search":
        return part_search(args.model, args.to)
    if args.part == "peak":
        before = [int(b) for b in args.before.split(",") if b]
        return part_peak(args.model, args.precision, args.plan, args.batch, before, args.to)
    if args.part == "eager-allocator":
        return part_eager_allocator(args.model, args.to)
    if args.part == "speed":
        return part_speed(args.model, args.precision, args.plan, args.batch, args.how)
    from autotune.device import backend_for

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.markdown_only:
        (out / "compile-cpu.md").write_text(markdown(json.loads((out / "compile-cpu.json").read_text())) + "\n")
        return None
    data = {"benchmark": "compile", "command": " ".join(["python benchmarks/compile.py", *sys.argv[1:]]),
            "environment": backend_for("cpu").environment(), "date": datetime.date.today().isoformat(),
            "search": {k: v for k, v in SEARCH.items()}, "check_batch_size": CHECK_BATCH, "models": []}
    started, load = time.monotonic(), os.getloadavg()[0]  # other jobs on the machine slow every step
    with tempfile.TemporaryDirectory(prefix="autotune-compile-bench-") as scratch:
        for name in args.models.split(","):
            data["models"].append(run_model(name, out, Path(scratch), args))
            stem = out / "compile-cpu"  # what is measured so far, should the run be stopped before its end
            stem.with_suffix(".json").write_text(json.dumps({**data, "partial": True}, indent=2, default=str) + "\n")
    data["wall_s"] = round(time.monotonic() - started, 1)
    data["load_average"] = {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)}
    stem = out / "compile-cpu"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(data) + "\n")
    print(markdown(data))
    over = [f"{m['name']} {v['precision']}/{v['plan']}: {v['compiles']}" for m in data["models"] for v in m["variants"]
            if v["compiles"] > 2]
    assert not over, f"graphs compiled per variant, more than 2 (the figures are written): {', '.join(over)}"


if __name__ == "__main__":
    main()

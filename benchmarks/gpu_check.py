"""GPU check: the CUDA meter, OOM recovery, a sticky CUDA error and a small tune, on one NVIDIA GPU.

Run with ``bash benchmarks/gpu_check.sh`` on a machine with a CUDA build of torch (a few
minutes). It prints allocated vs reserved vs NVML figures and exits non-zero if a check fails.
What the CPU tests check against a faked ``torch.cuda`` and NVML (tests/meters/test_meters_cuda.py,
tests/test_device.py) is checked here on the real thing: the budget set only inside a measured
region, per-step allocated peaks, an OOM's held and needed bytes, the NVML device found by UUID,
bf16 offered only with hardware support, a device-side assert recorded as ``crashed``, activation
offload's device and host peaks, copy rate and step time against the same plans without it.

Section 4c holds the time model (autotune/timing) against this GPU: section 4's space as a ``--device cuda
--dry-run`` for the card this GPU is (``--card``, found from its name), each predicted step against the measured one.

Section 7 runs a compiled search (``--compile none,default``): every configuration eager and compiled, measured by
the CUDA meter, at most 2 graphs per variant, no graph break, the static re-timing of a compiled recommendation.

Section 6 checks the model of the caching allocator (autotune/meters/caching_allocator.py): raw allocation
patterns replayed against the real allocator in a fresh process (exact), then every configuration the sections
above measured, predicted under fake tensors with a traced tensor meter and replayed, against its measured
allocated (within 1%), reserved (within 5%) and NVML figures (printed; the context is calibrated here). Each is
predicted both ways a ``--device cuda --dry-run`` predicts: on fake CUDA tensors (a machine with a GPU), and on the
CPU's fake tensors with CUDA's autocast lists (autotune/execution/cuda_rules.py: a machine without one). Section 4b
runs ``--device cuda --dry-run`` of section 4's space, here and in a process that sees no GPU, against section 4's
measured trials.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

import autotune
from autotune.device import backend_for
from autotune.execution.cuda_rules import CudaFindings, CudaRules
from autotune.execution.spawn import Spawned
from autotune.meters import TensorMeter
from autotune.meters.caching_allocator import (CUDA_CONTEXT_BYTES, AllocatorSettings, cublas_workspace_bytes,
                                               nvml_bytes, replay, workspace_trace)
from autotune.meters.cuda import CudaMeter, nvml_handle
from autotune.records import Config, Measurement, TrialSettings
from autotune.report import Report
from autotune.report import load as load_report
from autotune.execution.trial import TrialWork, run_trial
from autotune.units import format_bytes
from autotune.training.workload import Workload

GiB, MiB, KiB = 2**30, 2**20, 2**10
failures: list[str] = []
ALLOCATED_TOLERANCE, RESERVED_TOLERANCE = 0.01, 0.05  # predicted vs measured, relative to the measured figure


@dataclasses.dataclass(frozen=True)
class Measured:
    """A configuration a section measured, to predict in section 6."""

    label: str
    workload: Workload
    settings: TrialSettings
    budget_bytes: int | None  # the budget it ran under (set_per_process_memory_fraction)
    measurement: Measurement
    metered_steps: int  # the steps its metered region ran: warm-up, plus the timed steps of a timed trial


measured: list[Measured] = []


def remember(label: str, workload: Workload, settings: TrialSettings, budget_bytes: int | None, m: Measurement) -> None:
    """Keep a measured trial for section 6's prediction (CUDA meters its warm-up and timed steps in one region)."""
    measured.append(Measured(label, workload, settings, budget_bytes, m, settings.warmup_steps + len(m.step_times_s)))


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        failures.append(what)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device visible: this check needs an NVIDIA GPU and a CUDA build of torch")
        return 2
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name}, {format_bytes(props.total_memory)}")

    backend = backend_for(dev)
    names = backend.supported_precisions()
    print(f"0. precisions {names}; compute capability {props.major}.{props.minor}; NVML handle {nvml_handle(dev)}")
    check(("bf16" in names) == (props.major >= 8 or bool(torch.version.hip)), "bf16 offered exactly where the GPU has it")

    print("1. CUDA meter: a known allocation, then per-step peaks")
    meter = CudaMeter(dev)
    with meter.measure() as h:
        x = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # 256 MiB
        y = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)  # 128 MiB
        del x, y
        h.reset_peak()
        z = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)  # a later "step" of 64 MiB
        step_allocated, step_reserved = h.peak_bytes(), h.peak_reserved_bytes()
        del z
    r = h.reading
    print(f"  second step: allocated peak {format_bytes(step_allocated)}, reserved {format_bytes(step_reserved)}")
    check(step_allocated == 64 * 2**20, "a step's allocated peak is its own (64 MiB), not the region's")
    print(f"  allocated {format_bytes(r.peak_allocated_bytes)}, reserved {format_bytes(r.peak_reserved_bytes)}, "
          f"NVML device-used {format_bytes(r.peak_nvml_bytes)}")
    check(r.peak_allocated_bytes == 384 * 2**20, "max_memory_allocated is exactly the 384 MiB allocated")
    check(r.peak_reserved_bytes >= r.peak_allocated_bytes, "reserved >= allocated")
    check(r.peak_nvml_bytes is None or r.peak_nvml_bytes >= r.peak_reserved_bytes,
          "NVML device-used >= reserved (it adds the CUDA context)")

    print("2. OOM under a budget, then recovery")
    workload = Workload.from_specs("autotune.examples:TinyGPT")
    budget = 2 * GiB
    meter = CudaMeter(dev, budget_bytes=budget)
    settings = TrialSettings(warmup_steps=2, measure_steps=3)
    base = torch.cuda.memory_allocated(dev)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: None)(dev)
    ooms = [run_trial(workload, Config("fp32", 0, 4096), device=dev, meter=meter, settings=settings) for _ in range(5)]
    statuses = [m.status for m in ooms]
    ok = run_trial(workload, Config("fp32", 0, 8), device=dev, meter=meter, settings=settings)
    print(f"  5 x batch 4096: {statuses}; then batch 8: {ok.status}, peak reserved {format_bytes(ok.peak_bytes)}, "
          f"allocated {format_bytes(ok.peak_allocated_bytes)}, NVML {format_bytes(ok.peak_nvml_bytes)}")
    print(f"  the first oom: held {format_bytes(ooms[0].oom_held_bytes)}, needed {format_bytes(ooms[0].oom_needed_bytes)}, "
          f"peak {format_bytes(ooms[0].peak_bytes)}")
    check(statuses == ["oom"] * 5, "batch 4096 is an oom outcome under a 2 GiB budget, five times")
    check(ooms[0].oom_held_bytes is not None and ooms[0].oom_held_bytes <= budget < (ooms[0].oom_needed_bytes or 0)
          == ooms[0].peak_bytes, "an oom trial holds less than the budget and needed more, its peak the need")
    check(getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: None)(dev) == fraction,
          "the memory fraction is back to what it was outside the measured regions")
    check(ok.status == "ok" and ok.peak_bytes <= budget, "a small trial after the OOMs runs and fits")
    check(torch.cuda.memory_allocated(dev) == base, "allocated memory back to where it started")
    memory = run_trial(workload, Config("fp32", 0, 8), device=dev, meter=meter, settings=settings, timed=False)
    print(f"  a memory trial of batch 8: allocated {format_bytes(memory.peak_allocated_bytes)}, reserved "
          f"{format_bytes(memory.peak_reserved_bytes)}, {len(memory.step_times_s)} timed steps")
    check(memory.status == "ok" and memory.samples_per_s is None and memory.step_times_s == (),
          "a memory trial (the search's bracket) is metered and not timed")
    check(memory.peak_allocated_bytes == ok.peak_allocated_bytes,
          "its warm-up steps reach the timed trial's allocated peak (CUDA meters the warm-up, then times)")
    remember("2. fp32 0 b8, timed", workload, settings, budget, ok)
    remember("2. fp32 0 b8, memory trial", workload, settings, budget, memory)

    print("3. A device-side assert in a worker is a crashed trial; the next trial runs")
    crash_w = Workload.from_specs("tests.models:DeviceAssert")
    crashed = Spawned(dev).run(crash_w, TrialWork(Config("fp32", 0, 4), settings, None))
    after = Spawned(dev).run(crash_w, TrialWork(Config("fp32", 0, 2), settings, None))
    print(f"  batch 4: {crashed.status} ({crashed.error}); batch 2: {after.status}")
    check(crashed.status == "crashed" and "CUDA" in (crashed.error or ""), "the device-side assert is recorded as crashed")
    check(after.status == "ok", "a fresh worker trains the next trial")

    print("3b. Warm workers: one worker serves an ok trial, an OOM and another, and measures as fresh workers do")
    works = [TrialWork(Config("fp32", 0, 8), settings, budget), TrialWork(Config("fp32", 0, 4096), settings, budget),
             TrialWork(Config("bf16" if "bf16" in names else "fp16", 0, 16), settings, budget)]
    with Spawned(dev) as warm, Spawned(dev, trials_per_worker=1) as fresh:
        warm_runs = [warm.run(workload, w) for w in works]
        fresh_runs = [fresh.run(workload, w) for w in works]
        started = warm.describe()
    print(f"  warm: {[(m.status, m.peak_allocated_bytes, round(m.setup_s or 0, 2)) for m in warm_runs]}; {started}")
    print(f"  fresh: {[(m.status, m.peak_allocated_bytes, round(m.setup_s or 0, 2)) for m in fresh_runs]}")
    check([m.status for m in warm_runs] == ["ok", "oom", "ok"], "warm: ok, oom, ok")
    check(started["workers_started"] == 1 and started["workers_replaced_unclean"] == 0,
          "one warm worker served all three (the OOM left it at its baseline)")
    check([m.peak_allocated_bytes for m in warm_runs] == [m.peak_allocated_bytes for m in fresh_runs],
          "a warm worker's allocated peaks equal fresh workers' (cuBLAS workspaces counted in both)")
    for w, m in zip(works, fresh_runs):
        remember(f"3b. {w.config}, fresh worker", workload, settings, budget, m)

    offload_checks(dev, names)
    prediction_checks(dev)
    compile_checks(names)

    print("4. A small tune: isolated trials (the CUDA default), then the probe on token_dataset")
    start = time.monotonic()
    report = autotune.tune("autotune.examples:TinyGPT", data="autotune.examples:token_dataset", device="cuda",
                           budget="4GiB", precisions="fp32,fp16,bf16", segments="0,3,every2,all", batch_sizes="8..512",
                           measure_steps=5, storage="sqlite:///gpu_check.db", study=f"gpu-check-{int(time.time())}",
                           target_batch_size=1024)
    print(report.table())
    print(f"  tune took {time.monotonic() - start:.1f} s")
    check(report.recommendation is not None, "a recommendation under 4 GiB")
    check(report.search["isolation"] == "process", "trials ran in worker processes")
    print(f"  workers started {report.search.get('workers_started')}, replaced unclean "
          f"{report.search.get('workers_replaced_unclean')}, set-up {report.search['setup_s']} s, steps "
          f"{report.search['steps_s']} s")
    for c in report.plan_checks:
        print(f"  plan check {c.plan}: {c.status}, relative difference {c.max_rel_diff}, run-to-run noise {c.noise}")
    check(bool(report.plan_checks) and all(c.ok for c in report.plan_checks),
          "every checkpoint plan passed its check on CUDA (bitwise, or within the plan-free step's own noise)")
    check(bool(report.probe) and all(r.peak_bytes_max for r in report.probe), "the probe measured per-step peaks on CUDA")
    check(all(r.peak_bytes_median <= (r.peak_reserved_bytes_max or 0) for r in report.probe if r.peak_bytes_median),
          "the probe's median step peak (allocated, reset per step) is below the reserved peak beside it")
    rows = [(m.config, m.peak_allocated_bytes, m.peak_reserved_bytes, m.peak_nvml_bytes) for m in report.trials if m.status == "ok"]
    print("  allocated / reserved / NVML per ok trial (MiB):")
    for config, a, res, n in rows:
        print(f"    {config}: {a / 2**20:.0f} / {res / 2**20:.0f} / {n / 2**20 if n else float('nan'):.0f}")
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    report.to_json(os.path.join(out, "gpu_check.json"))
    dry_run_checks(report, out)
    time_checks(report, out)
    print(json.dumps({"failures": failures}))
    return 1 if failures else 0


# Section 4's space as a dry run for CUDA plans it (4b, 4c)
DRY_RUN_ARGV = ["--model", "autotune.examples:TinyGPT", "--data", "autotune.examples:token_dataset", "--device", "cuda",
                "--budget", "4GiB", "--precisions", "fp32,fp16,bf16", "--segments", "0,3,every2,all", "--batch-sizes",
                "8..512", "--dry-run", "--quiet"]


def time_checks(measured: Report, out: str) -> None:
    """4c. Step times: section 4's space as a dry run for the card this GPU is (``--card``, from its name), each
    configuration's predicted step against section 4's measured one; printed with the median absolute error and the
    rank correlation (the cards' efficiencies are assumptions until a GPU checks them: this is that check)."""
    from autotune.timing.cards import card_named

    gpu = torch.cuda.get_device_name()
    name = card_named(gpu)
    if name is None:
        print(f"4c. {gpu} is no card of autotune/timing/cards.json: step times not compared")
        return
    path = os.path.join(out, "gpu_check-time.json")
    done = subprocess.run([sys.executable, "-m", "autotune", *DRY_RUN_ARGV, "--card", name, "--out", path],
                          capture_output=True, text=True, timeout=600)
    check(done.returncode == 0, f"4c. the dry run for --card {name} exits 0 ({done.stderr[-300:]})")
    if done.returncode != 0:
        return
    real = {m.config: m for m in measured.trials if m.status == "ok" and m.step_s}
    pairs = [(p, real[p.config]) for p in load_report(path).trials if p.status == "ok" and p.step_s and p.config in real]
    errors = sorted(abs(p.step_s / r.step_s - 1) for p, r in pairs)
    for p, r in pairs:
        print(f"    {p.config}: predicted {p.step_s:.4f} s, measured {r.step_s:.4f} s ({p.step_s / r.step_s - 1:+.1%})")
    median = errors[len(errors) // 2] if errors else None
    rank = _spearman([p.step_s for p, _ in pairs], [r.step_s for _, r in pairs]) if len(pairs) > 2 else None
    print(f"4c. step times on {gpu} (--card {name}): {len(pairs)} configurations timed and predicted; median absolute "
          f"error {median if median is None else f'{median:.1%}'}, Spearman {rank if rank is None else f'{rank:.3f}'}")
    check(bool(pairs), "4c. the predicted step times are compared with measured ones")


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists (no ties expected among step times)."""
    rank = lambda xs: {i: r for r, i in enumerate(sorted(range(len(xs)), key=xs.__getitem__))}  # noqa: E731
    ra, rb, n = rank(a), rank(b), len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def dry_run_checks(measured: Report, out: str) -> None:
    """4b. ``--device cuda --dry-run`` of section 4's space, both ways (this GPU's fake CUDA tensors in this process;
    the CPU's with CUDA's rules in a process that sees no GPU), against section 4's measured trials."""
    argv = DRY_RUN_ARGV
    runs = {}
    for way, hide in (("fake CUDA tensors", None), ("no GPU: the CPU's with CUDA's rules", "")):
        path = os.path.join(out, f"gpu_check-dry-run-{'cpu' if hide == '' else 'cuda'}.json")
        env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": hide} if hide is not None else {})}
        done = subprocess.run([sys.executable, "-m", "autotune", *argv, "--out", path], env=env, capture_output=True,
                              text=True, timeout=600)
        check(done.returncode == 0, f"4b. the dry run on {way} exits 0 ({done.stderr[-300:]})")
        runs[way] = load_report(path) if done.returncode == 0 else None
    real = {m.config: m for m in measured.trials if m.status == "ok" and m.memory_source == "cuda"}
    for way, report in runs.items():
        if report is None:
            continue
        pairs = [(m, real[m.config]) for m in report.trials if m.status == "ok" and m.config in real]
        worst_a = max((abs(relative(p.peak_allocated_bytes, r.peak_allocated_bytes)) for p, r in pairs), default=0.0)
        worst_r = max((abs(relative(p.peak_reserved_bytes, r.peak_reserved_bytes)) for p, r in pairs), default=0.0)
        print(f"4b. dry run on {way}: {len(pairs)} configurations also measured; worst allocated {worst_a:.2%}, "
              f"worst reserved {worst_r:.2%}; limits {[(d['precision'], d['segments'], d['max_batch_size']) for d in report.limits]}")
        for p, r in pairs:
            print(f"    {p.config}: allocated {format_bytes(p.peak_allocated_bytes)} vs {format_bytes(r.peak_allocated_bytes)}, "
                  f"reserved {format_bytes(p.peak_reserved_bytes)} vs {format_bytes(r.peak_reserved_bytes)}")
        check(bool(pairs) and worst_a <= ALLOCATED_TOLERANCE, f"4b. {way}: predicted allocated within 1% of measured")
        check(bool(pairs) and worst_r <= RESERVED_TOLERANCE, f"4b. {way}: predicted reserved within 5% of measured")


def compile_checks(names: list[str]) -> None:
    """Section 7: compiled training on CUDA, every configuration eager and compiled, measured by the CUDA meter (the
    caching allocator sees what compiled kernels allocate), one graph per variant, no graph break, the static
    re-timing of a compiled recommendation."""
    print("7. Compiled training: --compile none,default on TinyGPT (4 blocks, width 128, 64 tokens), grid")
    precisions = ",".join(p for p in ("fp32", "bf16") if p in names)
    start = time.monotonic()
    report = autotune.tune("autotune.examples:TinyGPT", model_kwargs={"n_layer": 4, "n_embd": 128, "block_size": 64},
                           device="cuda", budget="4GiB", precisions=precisions, segments="0,all", batch_sizes="8,16,32",
                           strategy="grid", compile="none,default", probe=False, compare_library=False,
                           storage="sqlite:///gpu_check.db", study=f"gpu-check-compile-{int(time.time())}")
    print(report.table())
    print(f"  tune took {time.monotonic() - start:.1f} s")
    trials = {(m.config.variant, m.batch_size): m for m in report.trials if not m.config.compile.endswith("+static")}
    compiled = [m for m in trials.values() if m.config.compiled]
    check(all(m.status == "ok" for m in report.trials), "every configuration ran, eager and compiled")
    check(len(compiled) * 2 == len(trials), "every configuration measured both ways")
    check(all(m.memory_source == "cuda" and m.peak_allocated_bytes for m in compiled),
          "compiled trials measured by the CUDA meter (allocated, reserved and NVML)")
    checks = {str(c.plan): c.compiles or 0 for c in report.plan_checks if c.compile == "default"}
    for variant in {m.config.variant for m in compiled}:
        graphs = sum(m.compiles or 0 for m in compiled if m.config.variant == variant)
        graphs += checks.get(str(variant.plan), 0) if variant.precision == "fp32" else 0  # the fp32 check's graph
        breaks = max(m.graph_breaks or 0 for m in compiled if m.config.variant == variant)
        print(f"  {variant}: {graphs} graphs compiled, {breaks} graph breaks")
        check(graphs <= 2, f"{variant}: at most 2 graphs compiled")
    check(all(m.graph_breaks == 0 for m in compiled), "no graph break in any compiled trial")
    for m in compiled:  # compiled against eager, the same configuration
        eager = trials[(m.config.variant._replace(compile="none"), m.batch_size)]
        print(f"  {m.config}: allocated {m.peak_allocated_bytes / MiB:.1f} MiB compiled, "
              f"{eager.peak_allocated_bytes / MiB:.1f} MiB eager; {m.samples_per_s:.0f} against "
              f"{eager.samples_per_s:.0f} samples/s")
    rec = report.recommendation
    if rec is not None and rec.config.compiled:
        check("static_compile" in report.search, "a compiled recommendation was re-timed static")
        print(f"  static re-timing: {report.search.get('static_compile')}")


def offload_checks(dev: torch.device, names: list[str]) -> None:
    """5. Activation offload on the real device: lower device peak, host peak about what moved, the time it costs."""
    print("5. Activation offload: a copy's rate by size, then plans with and without offload at one batch")
    stream = torch.cuda.Stream(dev)
    for size in (16 * 2**10, 64 * 2**10, 256 * 2**10, 2**20, 16 * 2**20):  # where offloading a tensor starts to pay
        src = torch.empty(size, dtype=torch.uint8, device=dev)
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for _ in range(50):
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
        stream.synchronize()
        seconds = (time.perf_counter() - start) / 50
        print(f"  device to pinned host, {format_bytes(size)}: {seconds * 1e6:.0f} us, {size / seconds / 2**30:.1f} GiB/s")
    workload = Workload.from_specs("autotune.examples:TinyGPT", model_kwargs={"n_layer": 8, "n_embd": 512, "n_head": 8,
                                                                             "block_size": 256})
    settings = TrialSettings(warmup_steps=2, measure_steps=5)
    meter = CudaMeter(dev)
    precision = "bf16" if "bf16" in names else "fp32"
    runs = {plan: run_trial(workload, Config(precision, plan, 16), device=dev, meter=meter, settings=settings)
            for plan in ("0", "0+offload", "4", "4+offload", "all", "all+offload")}
    for plan, m in runs.items():
        print(f"  {precision} {plan:12s} batch 16: {m.status}, allocated peak {format_bytes(m.peak_allocated_bytes)}, "
              f"host peak {format_bytes(m.host_peak_bytes) if m.host_peak_bytes else '-'}, step {m.step_s or 0:.4f} s")
    for plan, m in runs.items():
        remember(f"5. {precision} {plan} b16", workload, settings, None, m)
    for plan in ("0", "4", "all"):
        plain, off = runs[plan], runs[plan + "+offload"]
        if plain.status != "ok" or off.status != "ok":
            check(False, f"{plan} and {plan}+offload both ran ({plain.status}, {off.status})")
            continue
        drop = plain.peak_allocated_bytes - off.peak_allocated_bytes
        print(f"  {plan}: offload saves {format_bytes(drop)} ({drop / plain.peak_allocated_bytes:.0%}) of the device "
              f"peak for {off.step_s / plain.step_s:.2f}x the step time; the host held {format_bytes(off.host_peak_bytes)}")
        check(drop > 0, f"{plan}+offload peaks lower on the device than {plan}")
        check(off.host_peak_bytes >= drop, f"{plan}+offload's host peak covers what left the device")
    from autotune.execution.plan_check import check_plans

    workload = workload.with_chain(autotune.find_chain(workload.build_model(seed=0)))
    checks = check_plans(workload, ["0+offload", "4+offload", "all+offload"], batch_size=4, device=dev)
    for c in checks:
        print(f"  plan check {c.plan}: {c.status} ({c.max_rel_diff})")
    check(all(c.ok for c in checks), "every offloaded plan trains the model the plan-free step trains, on CUDA")


# -- 6. the caching allocator's model -------------------------------------------------------------------------


def events(*steps: tuple[str, int]) -> list[tuple[int, int]]:
    """A trace from ``("+", nbytes)`` (an allocation under the next key) and ``("-", k)`` (the k-th one's free)."""
    trace: list[tuple[int, int]] = []
    sizes: list[int] = []
    for kind, amount in steps:
        if kind == "+":
            sizes.append(amount)
            trace.append((amount, len(sizes)))
        else:
            trace.append((-sizes[amount - 1], amount))
    return trace


def allocator_patterns() -> list[tuple[str, list[tuple[int, int]], int | None, bool]]:
    """Raw allocation patterns, one rule each: (name, trace, capacity in bytes or None, expandable segments).
    Capacities sit 1 MiB above the figure the rule turns on: a memory fraction is a float of the device's bytes."""
    M = MiB
    return [
        ("100 B: one 2 MiB segment", events(("+", 100)), None, False),
        ("2 x 600 KiB share a segment", events(("+", 600 * KiB), ("+", 600 * KiB)), None, False),
        ("2 x 3 MiB from one 20 MiB segment", events(("+", 3 * M), ("+", 3 * M)), None, False),
        ("25 MiB: 26 MiB", events(("+", 25 * M)), None, False),
        ("16.5 MiB after 3 MiB: not split", events(("+", 3 * M), ("+", 16 * M + 512 * KiB)), None, False),
        ("freed neighbours merge", events(("+", 3 * M), ("+", 3 * M), ("-", 1), ("-", 2), ("+", 15 * M)), None, False),
        ("best fit", events(("+", 12 * M), ("+", 16 * M), ("-", 1), ("-", 2), ("+", 11 * M), ("+", 15 * M)), None,
         False),
        ("fragmentation", events(("+", 12 * M), ("+", 12 * M), ("-", 1), ("-", 2), ("+", 14 * M)), None, False),
        ("cache given back, retried", events(("+", 12 * M), ("-", 1), ("+", 30 * M)), 41 * M, False),
        ("a split segment kept", events(("+", 3 * M), ("+", 18 * M), ("-", 2), ("+", 20 * M)), 41 * M, False),
        ("out of memory", events(("+", 12 * M), ("+", 30 * M)), 41 * M, False),
        ("expandable: 2 x 25 MiB", events(("+", 25 * M), ("+", 25 * M)), None, True),
        ("expandable: freed pages merge", events(("+", 12 * M), ("+", 12 * M), ("+", 12 * M), ("-", 1), ("-", 2),
                                                 ("+", 24 * M)), None, True),
        ("expandable: unmapped, retried", events(("+", 30 * M), ("-", 1), ("+", 50 * M)), 61 * M, True),
    ]


def run_allocator_patterns() -> int:
    """In a fresh process (``--allocator-patterns``): run each pattern on the real allocator, one JSON line each."""
    dev = torch.device("cuda", 0)
    total = torch.cuda.mem_get_info(dev)[1]
    for name, trace, capacity, expandable in allocator_patterns():
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.set_per_process_memory_fraction(capacity / total if capacity else 1.0, dev)
        retries = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
        live, oom = {}, False
        try:
            for nbytes, key in trace:
                if nbytes > 0:
                    live[key] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                else:
                    del live[key]
        except torch.OutOfMemoryError:
            oom = True
        stats = torch.cuda.memory_stats(dev)
        print(json.dumps({"name": name, "allocated": torch.cuda.max_memory_allocated(dev), "oom": oom,
                          "reserved": torch.cuda.max_memory_reserved(dev),
                          "retries": stats.get("num_alloc_retries", 0) - retries}), flush=True)
        live.clear()
    torch.cuda.set_per_process_memory_fraction(1.0, dev)
    return 0


def predict_traced(workload: Workload, config: Config, device: torch.device, settings: TrialSettings,
                   steps: int, rules: CudaRules) -> tuple[tuple[int, int], ...]:
    """The allocation trace of a trial run under fake tensors, stepped ``steps`` times: predict_trial's run
    (autotune/execution/predict.py) mirrored until predict_trial takes a meter (``meter=TensorMeter(trace=True)``).
    ``rules``: CUDA's, on fake CUDA tensors (``device`` cuda) or on the CPU's (``device`` cpu), as a dry run on a
    machine without a GPU predicts."""
    from autotune.execution import predict

    run = predict._Predicted(workload.unwarmed(), config, device, settings)
    meter = TensorMeter(device, trace=True)
    try:
        with predict.fake_tensors(), predict._AsTheKernelsDo(cuda=True), rules.applied(CudaFindings()), meter.measure():
            run.build()
            for _ in range(steps):
                run.step(run.batch)
            if run.unprimed is not None:
                run.make_state()
    except Exception as exc:  # noqa: BLE001 - the model's own failure: its trace so far still says something
        print(f"  (the prediction of {config} failed: {type(exc).__name__}: {exc})")
    finally:
        run.release()
    return meter.last_trace or ()


def context_bytes(dev: torch.device) -> int:
    """NVML's device-used less what the allocator reserved, now: the CUDA context and kernels loaded so far, and
    other processes; the assumed default where NVML cannot be read."""
    handle = nvml_handle(dev)
    if handle is None:
        return CUDA_CONTEXT_BYTES
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used) - torch.cuda.memory_reserved(dev)


def relative(predicted: int, actual: int | None) -> float:
    return float("inf") if not actual else (predicted - actual) / actual


def prediction_checks(dev: torch.device) -> None:
    """6. The caching allocator's model: raw patterns exactly, then each measured configuration within tolerance."""
    print("6a. The allocator's rules: raw allocation patterns on the real allocator (a fresh process) vs the model")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--allocator-patterns"], capture_output=True,
                         text=True, timeout=300)
    real = {r["name"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}
    check(out.returncode == 0 and len(real) == len(allocator_patterns()), f"the patterns ran ({out.stderr[-300:]})")
    for name, trace, capacity, expandable in allocator_patterns():
        r = replay(trace, settings=AllocatorSettings(expandable_segments=expandable), capacity_bytes=capacity)
        got = real.get(name, {})
        model = {"allocated": r.peak_allocated_bytes, "reserved": r.peak_reserved_bytes, "retries": r.retries,
                 "oom": r.oom}
        print(f"  {name}: model {model}, real { {k: got.get(k) for k in model} }")
        check(all(got.get(k) == v for k, v in model.items()), f"6a. {name}: the model's figures are the allocator's")

    props = torch.cuda.get_device_properties(dev)
    workspace = cublas_workspace_bytes(props.major, props.minor)
    prelude = workspace_trace(workspace, threads=2)  # the step's thread and autograd's device thread
    context = context_bytes(dev)
    held = torch.cuda.memory_allocated(dev)
    print(f"6b. Predicted (fake tensors, traced, replayed) vs measured. Held now {format_bytes(held)}"
          f" (modelled: 2 cuBLAS workspaces of {format_bytes(workspace)}); NVML less reserved now "
          f"{format_bytes(context)} (assumed default {format_bytes(CUDA_CONTEXT_BYTES)})")
    # both ways a dry run predicts for CUDA: on fake CUDA tensors (a machine with a GPU), and on the CPU's with CUDA's
    # autocast lists (a machine without one: --device cuda --dry-run on a laptop or in CI)
    for way, rules in (("fake CUDA tensors", CudaRules(dev, fake_cuda=True)),
                       ("the CPU's fake tensors with CUDA's rules", CudaRules(torch.device("cpu")))):
        print(f"  predicted on {way}:")
        before = len(failures)
        for item in measured:
            predict_checks(item, rules, prelude, context)
        print(f"  {len(failures) - before} prediction check(s) failed of {len(measured)} configurations ({way})")


def predict_checks(item: Measured, rules: CudaRules, prelude: list[tuple[int, int]], context: int) -> None:
    """Predict one measured configuration and compare: outcome, allocated, reserved (counted), NVML (printed)."""
    m = item.measurement
    start = time.monotonic()
    trace = predict_traced(item.workload, m.config, rules.here, item.settings, item.metered_steps, rules)
    r = replay(prelude + list(trace), capacity_bytes=item.budget_bytes)
    took = time.monotonic() - start
    if r.oom or m.status == "oom":
        print(f"  {item.label}: predicted {'oom' if r.oom else 'ok'}, measured {m.status} ({took:.1f} s)")
        check(r.oom == (m.status == "oom"), f"{item.label}: the predicted outcome is the measured one")
        return
    if m.status != "ok":
        print(f"  {item.label}: measured {m.status}: nothing to compare")
        return
    nvml = nvml_bytes(r.peak_reserved_bytes, context_bytes=context)
    a = relative(r.peak_allocated_bytes, m.peak_allocated_bytes)
    res = relative(r.peak_reserved_bytes, m.peak_reserved_bytes)
    n = relative(nvml, m.peak_nvml_bytes)
    print(f"  {item.label} ({item.metered_steps} steps, {took:.1f} s): allocated {format_bytes(r.peak_allocated_bytes)}"
          f" vs {format_bytes(m.peak_allocated_bytes)} ({a:+.2%}), reserved {format_bytes(r.peak_reserved_bytes)} vs "
          f"{format_bytes(m.peak_reserved_bytes)} ({res:+.2%}), NVML {format_bytes(nvml)} vs "
          f"{format_bytes(m.peak_nvml_bytes)} ({n:+.2%}{'' if abs(n) <= RESERVED_TOLERANCE else ', outside 5%'})")
    check(abs(a) <= ALLOCATED_TOLERANCE, f"{item.label}: predicted allocated within 1% of max_memory_allocated")
    check(abs(res) <= RESERVED_TOLERANCE, f"{item.label}: predicted reserved within 5% of max_memory_reserved")


if __name__ == "__main__":
    sys.exit(run_allocator_patterns() if sys.argv[1:] == ["--allocator-patterns"] else main())

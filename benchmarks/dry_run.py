"""The dry run against measurement: predicted peaks beside measured ones, exact limits tried for real, models of any size.

    python benchmarks/dry_run.py [--out results] [--quick]

1. **Every plan kind on the bundled models.** TinyGPT and ResNetish (their default sizes), fp32, bf16 and bf16-true, plans
   0, 2, every2, all, sac-linear, sac-matmul, 2+offload and all+offload, batches 8 and 32, under a 1 GiB budget:
   each configuration's memory trial measured (the tensor meter) and predicted (the same trial under fake
   tensors): statuses, peaks and host peaks side by side.
2. **Exact limits, for real.** A dry run of fp32/0 and bf16/2 over batches 1..256 at 1 GiB bisects each limit
   L; real memory trials at L and at L+1 must fit and fail.
3. **A Llama-shaped 1.1B model at 2048 tokens, planned for 24 GiB** (``docs/examples/llama_factory.py``, random
   weights, bf16, ``--segments auto``, batches 1..512): the CLI's wall time and its process's peak memory, the
   state per parameter and a limit per plan.
4. **A 2-layer slice of the same widths** (256 tokens, bf16, plans 0, all and sac-linear) trained for real beside
   its prediction.
5. **A 7B shape planned for 80 GiB**: the state-does-not-fit answer (exit 3) without building the model, with its
   levers, the rank count it suggests checked by predicting one rank of an FSDP job of 2 (``--world-size 2``), and
   its bf16-true lever by predicting the same budget with ``--precisions bf16-true``.

Writes ``results/dry_run-cpu.json`` and ``.md`` (docs/dry-run.md includes the table). ``--quick`` skips 3-5;
``--only SECTION ...`` reruns those sections and keeps the others from the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

from autotune.execution.predict import predict_trial
from autotune.execution.trial import run_trial
from autotune.meters import TensorMeter
from autotune.plans.checkpointing import find_chain
from autotune.records import Config, TrialSettings
from autotune.training.workload import Workload
from autotune.units import format_bytes, parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"TinyGPT": "autotune.examples:TinyGPT", "ResNetish": "autotune.examples:ResNetish"}
PLANS = ("0", "2", "every2", "all", "sac-linear", "sac-matmul", "2+offload", "all+offload")
PRECISIONS = ("fp32", "bf16", "bf16-true")  # bf16-true: the model itself in bf16
BUDGET = parse_size("1GiB")
LLAMA = "docs.examples.llama_factory:tinyllama"
SEVEN_B = {"layers": 32, "hidden": 4096, "intermediate": 11008, "heads": 32, "kv_heads": 32}

# python -m autotune, printing its own peak resident memory on stderr as it exits: VmHWM, the high-water mark of this
# process's own memory (ru_maxrss would be the parent's where the child was spawned from a larger parent: Linux keeps
# it across exec)
_MAIN = ("import atexit, runpy, sys; atexit.register(lambda: print('maxrss_kib', next(int(line.split()[1]) for line "
         "in open('/proc/self/status') if line.startswith('VmHWM:')), file=sys.stderr)); sys.argv[0] = 'autotune'; "
         "runpy.run_module('autotune', run_name='__main__')")


def _workload(spec: str, **kwargs) -> Workload:
    workload = Workload.from_specs(spec, **kwargs)
    return workload.with_chain(find_chain(workload.build_model()))


def _pair(workload: Workload, config: Config, budget: int | None) -> dict:
    """One configuration measured (a memory trial from a model built for it) and predicted."""
    started = time.monotonic()
    measured = run_trial(workload.unwarmed(), config, device="cpu", meter=TensorMeter("cpu", budget_bytes=budget),
                         timed=False, settings=TrialSettings(timeout_s=None))
    measured_s, started = time.monotonic() - started, time.monotonic()
    predicted = predict_trial(workload, config, budget_bytes=budget)
    return {**config.to_dict(), "measured_status": measured.status, "predicted_status": predicted.status,
            "measured_peak_bytes": measured.peak_bytes, "predicted_peak_bytes": predicted.peak_bytes,
            "measured_host_peak_bytes": measured.host_peak_bytes, "predicted_host_peak_bytes": predicted.host_peak_bytes,
            "measured_s": round(measured_s, 3), "predicted_s": round(time.monotonic() - started, 3)}


def plan_kinds() -> list[dict]:
    rows = []
    for name, spec in MODELS.items():
        workload = _workload(spec)
        for precision in PRECISIONS:
            for plan in PLANS:
                for batch in (8, 32):
                    rows.append({"model": name, **_pair(workload, Config(precision, plan, batch), BUDGET)})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def exact_limits() -> list[dict]:
    import autotune

    rows = []
    for name, spec in MODELS.items():
        workload = _workload(spec)
        for precision, plan in (("fp32", "0"), ("bf16", "2")):
            report = autotune.tune(spec, device="cpu", budget=BUDGET, precisions=precision, segments=plan,
                                   batch_sizes="1..256", dry_run=True, results_dir=os.path.join(ROOT, "results", ".tmp"))
            (limit,) = report.limits
            row = {"model": name, "precision": precision, "segments": plan, "predicted_limit": limit["max_batch_size"],
                   "next": limit["min_oom_batch_size"], "exact": limit["exact"]}
            for key, b in (("at_limit", limit["max_batch_size"]), ("at_next", limit["min_oom_batch_size"])):
                if b is None:
                    continue
                m = run_trial(workload.unwarmed(), Config(precision, plan, b), device="cpu", timed=False,
                              meter=TensorMeter("cpu", budget_bytes=BUDGET), settings=TrialSettings(timeout_s=None))
                predicted = next(t for t in report.trials if t.batch_size == b)
                row[key] = {"batch_size": b, "status": m.status, "peak_bytes": m.peak_bytes,
                            "predicted_status": predicted.status, "predicted_peak_bytes": predicted.peak_bytes}
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _cli(args: list[str], out: str) -> dict:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _MAIN, *args, "--out", out, "--quiet"], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})
    rss = next(int(line.split()[1]) * 1024 for line in done.stderr.splitlines() if line.startswith("maxrss_kib"))
    said = [line for line in done.stderr.splitlines() if line.startswith("autotune:")]
    return {"command": "python -m autotune " + " ".join(args), "exit": done.returncode,
            "wall_s": round(time.monotonic() - started, 1), "max_rss_bytes": rss, "said": said[-1] if said else None}


def llama(out_dir: str) -> dict:
    out = os.path.join(out_dir, ".tmp", "tinyllama-dry-run.json")
    run = _cli(["--model", LLAMA, "--device", "cpu", "--budget", "24GiB", "--precisions", "bf16", "--segments", "auto",
                "--batch-sizes", "1..512", "--dry-run"], out)
    with open(out) as f:
        report = json.load(f)
    w = report["workload"]
    run.update(parameters=w["parameter_count"], state_bytes=w["fixed_bytes"],
               state_bytes_per_parameter=round(w["fixed_bytes"] / w["parameter_count"], 4),
               predictions=len(report["trials"]),
               failed={t["segments"]: t["error"] for t in report["trials"] if t["status"] == "failed"},
               limits={r["segments"]: [r["max_batch_size"], r["min_oom_batch_size"]] for r in report["limits"]})
    return run


def llama_slice() -> list[dict]:
    workload = _workload(LLAMA, model_kwargs={"layers": 2, "seq": 256})
    return [{"model": "tinyllama, 2 layers, 256 tokens", **_pair(workload, Config("bf16", plan, 4), None)}
            for plan in ("0", "all", "sac-linear")]


def seven_b(out_dir: str) -> dict:
    return _cli(["--model", LLAMA, "--model-kwargs", json.dumps(SEVEN_B), "--device", "cpu", "--budget", "80GiB",
                 "--precisions", "bf16", "--dry-run"], os.path.join(out_dir, ".tmp", "7b-dry-run.json"))


def seven_b_true(out_dir: str) -> dict:
    """The answer's bf16-true lever checked: the same 7B shape and budget with the weights, gradients and AdamW's
    state in bf16, predicted."""
    out = os.path.join(out_dir, ".tmp", "7b-bf16-true-dry-run.json")
    run = _cli(["--model", LLAMA, "--model-kwargs", json.dumps(SEVEN_B), "--device", "cpu", "--budget", "80GiB",
                "--precisions", "bf16-true", "--dry-run"], out)
    with open(out) as f:
        report = json.load(f)
    usable = report["budget_bytes"] * (1 - report["headroom"])
    run.update(predictions=len(report["trials"]), state=report["workload"]["state_by_precision"]["bf16-true"],
               limits={r["segments"]: [r["max_batch_size"], r["min_oom_batch_size"]] for r in report["limits"]},
               fits_within_headroom=sorted({t["segments"] for t in report["trials"]
                                            if t["status"] == "ok" and t["peak_bytes"] <= usable}))
    return run


def seven_b_sharded(out_dir: str) -> dict:
    """The rank count the 7B answer suggests, checked: one rank of an FSDP job of 2 predicted on a fake process group."""
    out = os.path.join(out_dir, ".tmp", "7b-fsdp2-dry-run.json")
    run = _cli(["--model", LLAMA, "--model-kwargs", json.dumps(SEVEN_B), "--device", "cpu", "--budget", "80GiB",
                "--precisions", "bf16", "--dry-run", "--parallel", "fsdp", "--world-size", "2"], out)
    with open(out) as f:
        report = json.load(f)
    usable = report["budget_bytes"] * (1 - report["headroom"])
    run.update(predictions=len(report["trials"]),
               limits={r["segments"]: [r["max_batch_size"], r["min_oom_batch_size"]] for r in report["limits"]},
               fits_within_headroom=sorted({t["segments"] for t in report["trials"]
                                            if t["status"] == "ok" and t["peak_bytes"] <= usable}))
    return run


def markdown(data: dict) -> str:
    rows = data["plan_kinds"]
    precisions = sorted({r["precision"] for r in rows}, key=PRECISIONS.index)
    exact = sum(r["measured_peak_bytes"] == r["predicted_peak_bytes"] for r in rows)
    same = sum(r["measured_status"] == r["predicted_status"] for r in rows)
    worst = max(abs(r["predicted_peak_bytes"] - r["measured_peak_bytes"]) / r["measured_peak_bytes"] for r in rows)
    host = sum(r["measured_host_peak_bytes"] == r["predicted_host_peak_bytes"] for r in rows)
    lines = [f"# The dry run against measurement ({data['environment']['machine']}, torch {data['environment']['torch']})",
             "", f"Command: `{data['command']}`.", "",
             f"**Every plan kind, both bundled models** ({', '.join(precisions)}; plans {', '.join(PLANS)}; batches 8 and 32; "
             f"budget 1 GiB): {len(rows)} memory trials measured and predicted. Statuses equal in {same} of "
             f"{len(rows)}; peaks equal to the byte in {exact} of {len(rows)} (the largest difference "
             f"{worst:.4%}); host peaks of offloaded plans equal in {host} of {len(rows)}. A prediction took "
             f"{_median([r['predicted_s'] for r in rows]):.2f} s (median), the measurement "
             f"{_median([r['measured_s'] for r in rows]):.2f} s.", "",
             "**Exact limits, tried for real** (a dry run over batches 1..256 at 1 GiB, then real memory trials at "
             "its limit L and at L+1):", "",
             "| model | variant | predicted L (next) | real trial at L | real trial at L+1 |", "| --- | --- | --- | --- | --- |"]
    for r in data["exact_limits"]:
        at, nxt = r.get("at_limit"), r.get("at_next")
        lines.append(f"| {r['model']} | {r['precision']}/{r['segments']} | {r['predicted_limit']} ({r['next'] or '-'}) | "
                     + (f"{at['status']}, {format_bytes(at['peak_bytes'])} (predicted {format_bytes(at['predicted_peak_bytes'])})"
                        if at else "-") + " | "
                     + (f"{nxt['status']} (predicted {nxt['predicted_status']})" if nxt else "-") + " |")
    if "llama" in data:
        ll = data["llama"]
        lines += ["", f"**A Llama-shaped model, {ll['parameters'] / 1e9:.2f}B parameters at 2048 tokens, planned for "
                      f"24 GiB** (`{ll['command']}`): {ll['predictions']} predictions in {ll['wall_s']} s of wall time; "
                      f"the process peaked at {format_bytes(ll['max_rss_bytes'])}; the state is "
                      f"{format_bytes(ll['state_bytes'])}, {ll['state_bytes_per_parameter']} bytes a parameter "
                      f"(weights, gradients and AdamW's two moments, fp32). Limits (largest batch that fits, the next "
                      f"one): " + _limits_text(ll["limits"]) + "."]
        if ll["failed"]:
            lines += ["", f"Plans {', '.join(sorted(ll['failed']))} failed their prediction "
                          f"(`{next(iter(ll['failed'].values()))}`); the same step fails for real on the slice below, "
                          f"and a search's plan check drops such a plan."]
        lines += ["", "**A 2-layer slice of the same widths** (256 tokens, bf16, batch 4), trained for real:", "",
                  "| plan | measured | predicted |", "| --- | --- | --- |"]
        lines += [f"| {r['segments']} | {r['measured_status']}, {format_bytes(r['measured_peak_bytes'])} "
                  f"({r['measured_peak_bytes']:,} B) | {r['predicted_status']}, {format_bytes(r['predicted_peak_bytes'])} "
                  f"({r['predicted_peak_bytes']:,} B) |" for r in data["slice"]]
        sb = data["seven_b"]
        lines += ["", f"**A 7B shape planned for 80 GiB** (`{sb['command']}`): exit {sb['exit']} in {sb['wall_s']} s, "
                      f"the process at {format_bytes(sb['max_rss_bytes'])}:", "", f"> {sb['said']}"]
        if "seven_b_sharded" in data:
            sh = data["seven_b_sharded"]
            lines += ["", f"**Its rank count checked** (`{sh['command']}`: one rank of 2 predicted on a fake process "
                          f"group): exit {sh['exit']} in {sh['wall_s']} s, {sh['predictions']} predictions, the process "
                          f"at {format_bytes(sh['max_rss_bytes'])}. Plans with a configuration predicted within the "
                          f"budget less headroom: {', '.join(sh['fits_within_headroom']) or 'none'}. Limits per rank "
                          f"(largest batch that fits, the next one): " + _limits_text(sh["limits"])
                      + "."]
        if "seven_b_true" in data:
            st = data["seven_b_true"]
            lines += ["", f"**Its bf16-true lever checked** (`{st['command']}`): exit {st['exit']} in {st['wall_s']} s, "
                          f"{st['predictions']} predictions, the process at {format_bytes(st['max_rss_bytes'])}; the "
                          f"state {format_bytes(sum(st['state'].values()))} (weights "
                          f"{format_bytes(st['state']['weights'])}, gradients {format_bytes(st['state']['gradients'])}, "
                          f"AdamW state {format_bytes(st['state']['optimizer_state'])}). Plans with a configuration "
                          f"predicted within the budget less headroom: {', '.join(st['fits_within_headroom']) or 'none'}. "
                          f"Limits (largest batch that fits, the next one): " + _limits_text(st["limits"]) + "."]
    return "\n".join(lines) + "\n"


def _limits_text(limits: dict) -> str:
    """``plan: largest batch that fits (the next one)``, for each plan of a dry run's report."""
    return ", ".join(f"{p}: {v[0] if v[0] is not None else 'none'} ({v[1]})" for p, v in limits.items())


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


SECTIONS = {"plan_kinds": lambda out: plan_kinds(), "exact_limits": lambda out: exact_limits(), "llama": llama,
            "slice": lambda out: llama_slice(), "seven_b": seven_b, "seven_b_sharded": seven_b_sharded,
            "seven_b_true": seven_b_true}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results"))
    parser.add_argument("--quick", action="store_true", help="only the bundled models (sections 1 and 2)")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS),
                        help="rerun these sections only, the others kept from the committed dry_run-cpu.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = {"command": "python benchmarks/dry_run.py" + (" --quick" if args.quick else ""),
            "environment": {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__}}
    if args.only:
        with open(os.path.join(args.out, "dry_run-cpu.json")) as f:
            kept = json.load(f)
        data = {**kept, "environment": data["environment"],
                "command": f"{kept['command']}, then python benchmarks/dry_run.py --only {' '.join(args.only)}"}
    names = args.only or (("plan_kinds", "exact_limits") if args.quick else SECTIONS)
    os.makedirs(os.path.join(args.out, ".tmp"), exist_ok=True)  # the CLI runs' reports
    for name in names:  # written after each section: a later one that fails keeps the earlier ones' work
        data[name] = SECTIONS[name](args.out)
        with open(os.path.join(args.out, "dry_run-cpu.json"), "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    with open(os.path.join(args.out, "dry_run-cpu.md"), "w") as f:
        f.write(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()

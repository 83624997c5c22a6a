"""The probe on the token dataset: docs/data-and-probe.md's command, run as a user would, and its probed candidates.

    python benchmarks/token_probe.py [--out results]   # about 3 minutes on two CPU cores

Runs ``python -m autotune --model autotune.examples:TinyGPT --data autotune.examples:token_dataset --device cpu
--budget 1GiB --target-batch-size 256 --precisions fp32,bf16 --segments 0,2 --batch-sizes 1..64`` in a fresh
directory (an empty trial store), with this checkout on ``PYTHONPATH``, and writes in ``--out``:

* ``token_probe-TinyGPT-cpu.json``: the run's report, as the command wrote it (``results/<study>.json`` there);
* ``token_probe-cpu.json``: the environment, the command, its exit status and wall time, and the figures the docs
  quote (each probed candidate's steps, worst-step peak against its trial's, samples/s; the recommendation and its
  accumulation plan);
* ``token_probe-cpu.md``: those figures as a table, from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.report import load  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

ARGS = ["--model", "autotune.examples:TinyGPT", "--data", "autotune.examples:token_dataset", "--device", "cpu",
        "--budget", "1GiB", "--target-batch-size", "256", "--precisions", "fp32,bf16", "--segments", "0,2",
        "--batch-sizes", "1..64"]
REPORT = "token_probe-TinyGPT-cpu.json"


def run(out: Path) -> dict:
    """The command in a fresh directory; its report copied to ``out``."""
    with tempfile.TemporaryDirectory() as where:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        started, load = time.monotonic(), os.getloadavg()[0]  # other jobs on the machine slow every step
        done = subprocess.run([sys.executable, "-m", "autotune", *ARGS], cwd=where, env=env, capture_output=True,
                              text=True, timeout=3600)
        wall_s = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"exit {done.returncode}:\n{done.stderr[-4000:]}")
        written = sorted((Path(where) / "results").glob("*.json"))  # results/<study>.json, the study named by the run
        if len(written) != 1:
            raise SystemExit(f"expected one report in results/, found {[p.name for p in written]}")
        shutil.copyfile(written[0], out / REPORT)
    return {"returncode": done.returncode, "wall_s": round(wall_s, 1),
            "load_average": {"start": round(load, 2), "end": round(os.getloadavg()[0], 2)},
            "last_lines": done.stdout.rstrip("\n").splitlines()[-3:]}


def figures(path: Path) -> dict:
    report = load(path)
    trials = {m.config: m for m in report.trials}
    rec = report.recommendation
    return {
        "environment": report.environment,
        "search_s": report.search["wall_s"], "trials": len(report.trials),
        "probe_settings": report.probe_settings,
        "candidates": [{"config": str(r.config), "accepted": r.accepted, "reason": r.reason, "steps": r.steps,
                        "samples": r.samples, "peak_bytes_max": r.peak_bytes_max,
                        "trial_peak_bytes": r.trial_peak_bytes if r.trial_peak_bytes is not None
                        else trials[r.config].peak_bytes,
                        "samples_per_s": r.samples_per_s, "trial_samples_per_s": trials[r.config].samples_per_s}
                       for r in report.probe or ()],
        "recommendation": None if rec is None else str(rec.config),
        "accumulation": report.accumulation,
    }


def markdown(data: dict) -> str:
    env = data["environment"]
    acc = data["accumulation"]
    lines = [f"# The probe on the token dataset ({env['device_name']}, torch {env['torch_version']})", "",
             f"Command: `{data['cli_command']}` in a fresh directory: exit {data['returncode']} in "
             f"{data['wall_s']:.0f} s ({data['trials']} trials in {data['search_s']:.0f} s of search, then the probe; the "
             f"machine's load average {data['load_average']['start']:.1f} at the start, "
             f"{data['load_average']['end']:.1f} at the end, on {env['cpu_count']} cores). "
             f"Written by `{data['command']}`; the report is `results/{REPORT}`.", "",
             "| candidate | accepted | steps | samples | worst step's peak | its trial's peak | difference "
             "| samples/s (probe) | samples/s (trial) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in data["candidates"]:
        accepted = "yes" if c["accepted"] else f"no: {c['reason']}"
        diff = c["peak_bytes_max"] - c["trial_peak_bytes"]
        lines.append(f"| {c['config']} | {accepted} | {c['steps']} | {c['samples']} | {format_bytes(c['peak_bytes_max'])} "
                     f"| {format_bytes(c['trial_peak_bytes'])} | {'+' if diff >= 0 else '-'}{format_bytes(abs(diff))} "
                     f"| {c['samples_per_s']:.1f} | "
                     f"{c['trial_samples_per_s']:.1f} |")
    lines += ["", f"Recommendation: {data['recommendation']}" + (
        "" if not acc else f"; accumulation: {acc['micro_batch_size']} x {acc['accumulation_steps']} = "
                           f"{acc['effective_batch_size']} for the target batch of {acc['target_batch_size']}") + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ran = run(out)
    data = {"benchmark": "token_probe", "command": " ".join(["python benchmarks/token_probe.py", *(argv or sys.argv[1:])]),
            "cli_command": "python -m autotune " + shlex.join(ARGS), **ran, "report": f"results/{REPORT}",
            **figures(out / REPORT)}
    (out / "token_probe-cpu.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "token_probe-cpu.md").write_text(markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

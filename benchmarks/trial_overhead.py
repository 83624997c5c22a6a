"""What a trial costs beyond its steps: the same search in this process, in a fresh worker per trial and in a warm worker.

    python benchmarks/trial_overhead.py [--out results]

Two spaces, each run three ways one after the other on fresh stores (``--isolation none``;
``--isolation process --trials-per-worker 1``, a worker per trial as before warm workers;
``--isolation process``, warm workers):

* issue 26's: TinyGPT made fast-stepping (4 layers of 32, context 32: steps of about 10 ms),
  1 GiB, fp32 and bf16, plans 0 and 2, batch sizes 1..64, the grid, no probe;
* a model whose build is slow beside its steps (TinyGPT at GPT-2 small's width and depth, 85M
  parameters, context 32), fp32, plan 0, batch sizes 1..4: the build a fresh worker repeats and a
  warm one makes once.

The report's ``search`` says how the trials' time split between set-up (a worker's start,
imports, the model's build) and steps. The modes must measure the same thing: every
configuration's status and peak are compared.

Writes ``trial_overhead-<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import autotune  # noqa: E402

MODES = {"none": ("in this process", dict(isolation="none")),
         "fresh": ("a fresh worker per trial", dict(isolation="process", trials_per_worker=1)),
         "warm": ("warm workers", dict(isolation="process"))}
SPACES = {
    "fast steps": dict(model_kwargs={"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4}, device="cpu",
                       budget="1GiB", precisions="fp32,bf16", segments="0,2", batch_sizes="1..64", strategy="grid",
                       probe=False),
    "large build": dict(model_kwargs={"n_layer": 12, "block_size": 32, "n_embd": 768, "n_head": 12}, device="cpu",
                        budget="8GiB", precisions="fp32", segments="0", batch_sizes="1..4", strategy="grid",
                        probe=False),
}


def run(space: str, mode: str, store: Path) -> dict:
    label, isolation = MODES[mode]
    started = time.monotonic()
    report = autotune.tune("autotune.examples:TinyGPT", storage=f"sqlite:///{store / space.replace(' ', '-')}-{mode}.db",
                           **isolation, **SPACES[space])
    return {"space": space, "mode": mode, "isolation": label, "trials": len(report.trials),
            "wall_s": round(time.monotonic() - started, 1), "search_s": report.search["wall_s"],
            "setup_s": report.search["setup_s"], "steps_s": report.search["steps_s"],
            "workers_started": report.search.get("workers_started"),
            "measured": {str(m.config): [m.status, m.peak_bytes] for m in report.trials},
            "device_name": report.environment.get("device_name")}


def table(rows: list[dict]) -> str:
    lines = ["| space | isolation | trials | workers started | search wall | vs in-process | set-up in it | steps in it |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = next(b["search_s"] for b in rows if b["space"] == r["space"] and b["mode"] == "none")
        started = "-" if r["workers_started"] is None else r["workers_started"]
        lines.append(f"| {r['space']} | `{r['mode']}` ({r['isolation']}) | {r['trials']} | {started} | "
                     f"{r['search_s']:.1f} s | {r['search_s'] / base:.2f}x | {r['setup_s']:.1f} s | {r['steps_s']:.1f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as store:
        rows = [run(space, mode, Path(store)) for space in SPACES for mode in MODES]
    same = all(r["measured"] == next(b["measured"] for b in rows if b["space"] == r["space"]) for r in rows)
    command = "python benchmarks/trial_overhead.py" + ("" if args.out == str(ROOT / "results") else f" --out {args.out}")
    device = rows[0]["device_name"] or "this CPU"
    text = (f"# Trial overhead: the same search in this process, a worker per trial and warm workers ({device})\n\n"
            f"Command: `{command}`\n\n{table(rows)}\n\n"
            f"Statuses and peaks of every configuration {'equal' if same else 'DIFFER'} between the modes of a space. "
            f"Set-up runs from the search asking for a trial to its first step; the rest of a worker's wall time is "
            f"its release, the check that it holds no more than before its first trial, and the result's way back. "
            f"The search's wall time leaves out the plan checks before it, which start the first warm worker where the "
            f"space has a checkpoint plan (the first space); in the second the first trial starts it.\n")
    (out / "trial_overhead-cpu.json").write_text(json.dumps({"command": command, "same_measurements": same,
                                                             "rows": rows}, indent=2) + "\n")
    (out / "trial_overhead-cpu.md").write_text(text)
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

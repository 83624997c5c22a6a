"""What a trial costs beyond its steps: the same search in this process and in a fresh worker per trial, side by side.

    python benchmarks/trial_overhead.py [--out results]

The space of issue 26: TinyGPT made fast-stepping (4 layers of 32, context 32: steps of about
10 ms), 1 GiB, fp32 and bf16, plans 0 and 2, batch sizes 1..64, the grid, no probe. Each mode
runs the whole space on a fresh store, one after the other; the report's ``search`` says how the
trials' time split between set-up (a worker's start, imports, the model's build) and steps. The
two modes must measure the same thing: every configuration's status and peak are compared.

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

MODES = {"none": "in this process", "process": "a fresh worker per trial"}
SPACE = dict(model_kwargs={"n_layer": 4, "block_size": 32, "n_embd": 32, "n_head": 4}, device="cpu", budget="1GiB",
             precisions="fp32,bf16", segments="0,2", batch_sizes="1..64", strategy="grid", probe=False)


def run(mode: str, store: Path) -> dict:
    started = time.monotonic()
    report = autotune.tune("autotune.examples:TinyGPT", isolation=mode, storage=f"sqlite:///{store / mode}.db", **SPACE)
    return {"mode": mode, "isolation": MODES[mode], "trials": len(report.trials), "wall_s": round(time.monotonic() - started, 1),
            "search_s": report.search["wall_s"], "setup_s": report.search["setup_s"], "steps_s": report.search["steps_s"],
            "measured": {str(m.config): [m.status, m.peak_bytes] for m in report.trials},
            "device_name": report.environment.get("device_name")}


def table(rows: list[dict]) -> str:
    base = rows[0]["search_s"]
    lines = ["| isolation | trials | search wall | vs in-process | set-up in it | steps in it |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| `{r['mode']}` ({r['isolation']}) | {r['trials']} | {r['search_s']:.1f} s | "
                     f"{r['search_s'] / base:.2f}x | {r['setup_s']:.1f} s | {r['steps_s']:.1f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as store:
        rows = [run(mode, Path(store)) for mode in MODES]
    same = rows[0]["measured"] == rows[1]["measured"]
    command = "python benchmarks/trial_overhead.py" + ("" if args.out == str(ROOT / "results") else f" --out {args.out}")
    device = rows[0]["device_name"] or "this CPU"
    text = (f"# Trial overhead: the same search in this process and in a worker per trial ({device})\n\n"
            f"Command: `{command}`\n\n{table(rows)}\n\n"
            f"Statuses and peaks of every configuration {'equal' if same else 'DIFFER'} between the modes. Set-up runs "
            f"from the search asking for a trial to its first step; the rest of a worker's wall time is its exit and "
            f"the result's way back.\n")
    (out / "trial_overhead-cpu.json").write_text(json.dumps({"command": command, "same_measurements": same,
                                                             "rows": rows}, indent=2) + "\n")
    (out / "trial_overhead-cpu.md").write_text(text)
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the command line prints, as a newcomer sees it: each run in a fresh temporary directory, its stdout and stderr
written to ``results/`` for the docs to include, so that the pages quote a real run and stay in sync with it.

    python benchmarks/cli_examples.py [--out results] [--only NAME ...]   # a few minutes on two CPU cores
    python benchmarks/sync_docs.py                                          # the docs' copies

Writes ``cli-<name>-cpu.md`` per run:

* ``quickstart``: the README's quick start (TinyGPT, 1 GiB, fp32 and bf16, plans 0 and 2, batch sizes 1..64):
  a table with a recommendation, exit 0 (docs/first-run.md);
* ``tight``: the same under 24 MiB, where some configurations run out of memory (docs/first-run.md);
* ``nothing-fits``: under 16 MiB (trials run, nothing fits: exit 3) and under 6 MiB (the training state alone is
  over the budget: exit 3 before any trial) (docs/first-run.md);
* ``hf-factory``: docs/examples/hf_factory.py's tiny GPT-2 from its config, with its data factory (docs/workload.md);
* ``lora``: a transformers Llama under a PEFT LoRA adapter (``autotune.thirdparty:hf_lora``), bf16 beside bf16-true,
  its evaluation limits measured and its exports written (docs/fine-tuning.md);
* ``eight-bit``: a wider TinyGPT in bf16-true with AdamW, then with bitsandbytes' 8-bit AdamW (needs ``pip install
  bitsandbytes``, 0.50 or later on a CPU) (docs/fine-tuning.md).

Each command runs as a user would type it (``python -m autotune ...``), in a new directory, with this checkout on
``PYTHONPATH`` (the factory example's ``docs.examples`` module is imported from a copy of ``docs/`` there).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

QUICKSTART = ["--model", "autotune.examples:TinyGPT", "--device", "cpu", "--budget", "1GiB", "--precisions", "fp32,bf16",
              "--segments", "0,2", "--batch-sizes", "1..64"]


def _with_budget(budget: str) -> list[str]:
    args = list(QUICKSTART)
    args[args.index("--budget") + 1] = budget
    return args


HF = ["--model", "docs.examples.hf_factory:causal_lm", "--data", "docs.examples.hf_factory:random_tokens", "--device",
      "cpu", "--budget", "256MiB", "--precisions", "fp32,bf16", "--batch-sizes", "1..32"]

LORA = ["--model", "autotune.thirdparty:hf_lora", "--model-kwargs",
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "vocab_size": 1024, "max_position_embeddings": 128, "r": 8}',
        "--device", "cpu", "--budget", "48MiB", "--precisions", "bf16,bf16-true", "--segments", "0,all",
        "--batch-sizes", "1..32", "--export", "hf,lightning", "--out", "lora.json"]
# A TinyGPT whose state is most of the budget (4.2M parameters, 32 tokens): what an optimizer's state costs shows
EIGHT_BIT = ["--model", "autotune.examples:TinyGPT", "--model-kwargs",
             '{"n_layer": 4, "n_embd": 256, "block_size": 32, "vocab_size": 4096}', "--device", "cpu", "--budget", "48MiB",
             "--precisions", "bf16-true", "--segments", "0", "--batch-sizes", "1..16", "--no-eval-limits"]

# name: (what the run shows, [commands]); each command a list of arguments of python -m autotune
RUNS = {
    "quickstart": ("the README's quick start", [QUICKSTART]),
    "tight": ("the quick start under a budget of 24 MiB", [_with_budget("24MiB")]),
    "nothing-fits": ("the quick start under budgets nothing fits", [_with_budget("16MiB"), _with_budget("6MiB")]),
    "hf-factory": ("docs/examples/hf_factory.py's tiny GPT-2, with its data factory", [HF]),
    "lora": ("a Llama under a LoRA adapter, bf16 and bf16-true", [LORA]),
    "eight-bit": ("TinyGPT in bf16-true with AdamW, then bitsandbytes' 8-bit AdamW",
                  [EIGHT_BIT, [*EIGHT_BIT, "--optimizer", "bitsandbytes.optim:AdamW8bit"]]),
}


def run(args: list[str]) -> dict:
    """``python -m autotune ARGS`` in a fresh directory (``docs/`` copied there for the factory example)."""
    with tempfile.TemporaryDirectory() as where:
        shutil.copytree(ROOT / "docs" / "examples", Path(where) / "docs" / "examples")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop("COLUMNS", None)
        load = os.getloadavg()[0]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "autotune", *args], cwd=where, env=env, capture_output=True,
                              text=True, timeout=1800)
        return {"command": "python -m autotune " + shlex.join(args), "returncode": done.returncode,
                "wall_s": time.monotonic() - started, "load": load, "stdout": done.stdout.rstrip("\n"),
                "stderr": done.stderr.rstrip("\n")}


def markdown(name: str, what: str, runs: list[dict]) -> str:
    import torch

    from autotune.device import backend_for

    cpu = backend_for("cpu").environment()["device_name"]  # the name every report's environment gives this CPU
    lines = [f"From `python benchmarks/cli_examples.py --only {name}` ({what}), each command in a fresh directory, on "
             f"{cpu} ({os.cpu_count()} cores), torch {torch.__version__}, "
             f"{datetime.date.today().isoformat()}. Step times and samples/s move from run to run; peaks and limits do "
             f"not.", ""]
    for r in runs:
        lines += [f"`{r['command']}`: exit {r['returncode']} in {r['wall_s']:.1f} s (the machine's load average "
                  f"{r['load']:.1f} as it started).", ""]
        if r["stdout"]:
            lines += ["stdout:", "", "```", r["stdout"], "```", ""]
        if r["stderr"]:
            lines += ["stderr:", "", "```", r["stderr"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results"))
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="these runs only (default: all)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or RUNS:
        what, commands = RUNS[name]
        runs = [run(c) for c in commands]
        path = out / f"cli-{name}-cpu.md"
        path.write_text(markdown(name, what, runs) + "\n")
        print(f"{path}: " + ", ".join(f"exit {r['returncode']} in {r['wall_s']:.1f} s" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

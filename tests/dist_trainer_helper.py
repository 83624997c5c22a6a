"""One rank of test_distributed's Hugging Face check, started with torchrun's environment variables.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.dist_trainer_helper OUT_DIR

Every rank builds the docs' example trainer (docs/examples/tune_hf_trainer.py), calls tune_trainer on it as it
would call trainer.train(), then trains one epoch; each rank writes what its trainer was set to, and rank 0 the
report's summary, to OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import sys

import torch

from autotune.integrations.transformers import tune_trainer


def main(out: str) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("tune_hf_trainer", os.path.join(here, "docs", "examples",
                                                                                  "tune_hf_trainer.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    trainer = example.make_trainer(os.path.join(out, "hf"))
    report = tune_trainer(trainer, budget=example.BUDGET, precisions="fp32", segments="0,all", measure_steps=2,
                          compare_library=False, storage=f"sqlite:///{out}/s.db")
    trainer.train()
    args = trainer.args
    best = report.recommendation
    found = {"rank": args.process_index, "world_size": args.world_size,
             "per_device_train_batch_size": args.per_device_train_batch_size,
             "gradient_accumulation_steps": args.gradient_accumulation_steps, "global_step": trainer.state.global_step,
             "recommendation": [best.precision, best.segments, best.batch_size],
             "distributed": report.distributed, "trials": len(report.trials)}
    with open(os.path.join(out, f"rank{args.process_index}.json"), "w") as f:
        json.dump(found, f)
    torch.distributed.destroy_process_group()  # as a script ends its job: no group's threads left at exit


if __name__ == "__main__":
    faulthandler.enable()  # an abort (SIGABRT) prints each thread's Python stack: where a rank died, if one does
    main(sys.argv[1])

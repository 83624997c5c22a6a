"""One rank of test_distributed's Hugging Face check, started with torchrun's environment variables.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.dist_trainer_helper OUT_DIR

Every rank builds the docs' example trainer (docs/examples/tune_hf_trainer.py), calls tune_trainer on it as it
would call trainer.train(), then trains one epoch; each rank writes what its trainer was set to, and rank 0 the
report's summary, to OUT_DIR/rank<r>.json; then it ends the job (end_job) and adds how many gloo worker threads
were left running, which must be none.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib.util
import json
import os
import sys
import types

import torch

from autotune.integrations.transformers import tune_trainer


def main(out: str) -> dict:
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
    return found


def gloo_threads() -> int | None:
    """How many of gloo's worker threads (``pt_gloo_runloop``) this process runs; None where /proc cannot say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def end_job() -> None:
    """Destroy the default group and let go of every reference to it, so that its gloo threads are joined now.

    A rank used to die at exit, rarely and under load, with "terminate called without an active exception"
    (SIGABRT, exit -6; twice in CI, once here with a core dump): a pt_gloo_runloop thread, having finished Hugging
    Face's last all_gather (store_flos) and woken the caller, freed the work's tensors, and a tensor Python made
    needs the GIL to be freed (~AsyncAllgatherWork -> decref_pyobject -> take_gil); the scheduler had delayed that
    thread until the main thread was in Py_FinalizeEx, where a thread asking for the GIL is made to exit, inside a
    noexcept destructor. The group's threads were still there because destroy_process_group() only unregisters a
    group: two references kept it alive. One was optuna's stored ImportError of redis, whose traceback held the
    frames that first imported optuna, tune_trainer's with the trainer and its DDP wrapper (fixed in autotune:
    the package imports optuna itself). The other is DeepSpeed's: deepspeed.comm.torch binds the default group
    into its functions' default arguments when it is imported. With no reference left, the group's destructor
    joins its threads (the GIL released) while Python is fully alive, so a delayed worker finishes first.
    """
    world = torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()
    for f in gc.get_objects():  # DeepSpeed's default arguments (TorchBackend.barrier's group=WORLD, ...)
        if isinstance(f, types.FunctionType) and f.__defaults__ and any(d is world for d in f.__defaults__):
            f.__defaults__ = tuple(None if d is world else d for d in f.__defaults__)
    del world
    gc.collect()  # the trainer and its DDP wrapper left main() in reference cycles: collected now, not at exit


if __name__ == "__main__":
    faulthandler.enable()  # an abort (SIGABRT) prints each thread's Python stack: where a rank died, if one does
    found = main(sys.argv[1])
    end_job()
    found["gloo_threads_left"] = gloo_threads()
    with open(os.path.join(sys.argv[1], f"rank{found['rank']}.json"), "w") as f:
        json.dump(found, f)

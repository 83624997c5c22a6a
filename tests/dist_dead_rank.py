"""One rank of test_distributed's dead-rank check, started with torchrun's environment variables.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m tests.dist_dead_rank

Rank 1 dies at the worst moment for rank 0: after it took a trial's command, before the trial's process group is
made (making a group waits for every rank until the group's timeout; here the trial's limit, 600 s, and a minute).
Rank 0 must say at once that a rank of the job is gone, which it prints.
"""

from __future__ import annotations

import os

import torch

from autotune.errors import AutotuneError
from autotune.execution import job as jobs
from autotune.execution.ranks import Ranks
from autotune.execution.trial import TrialWork
from autotune.records import Config, TrialSettings
from autotune.training.workload import Workload


def main() -> None:
    device = torch.device("cpu")
    job = jobs.join("ddp", device)
    if job.rank == 1:
        job.receive()
        os._exit(9)  # as SIGKILL would end it: no goodbye to the other rank
    workload = Workload.from_specs("autotune.examples:TinyGPT",
                                   model_kwargs='{"n_layer": 1, "block_size": 8, "n_embd": 8, "n_head": 2}')
    work = TrialWork(Config("fp32", "0", 2), TrialSettings(timeout_s=600.0), None)
    try:
        Ranks(device, job).run(workload, work)
        print("the trial ran without rank 1")
    except AutotuneError as exc:
        print(exc)
    os._exit(0)  # the default group's teardown would wait for rank 1 too


if __name__ == "__main__":
    main()

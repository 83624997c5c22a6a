"""Where and how a piece of work runs: a trial, a probe candidate, a plan check.

* :mod:`~autotune.execution.work`: the contract: a piece of work, the place it runs at, a venue.
* :mod:`~autotune.execution.venue`: the venues and the one choice among them; this process (``Here``).
* :mod:`~autotune.execution.spawn`: the venue of a fresh spawned worker process per piece of work.
* :mod:`~autotune.execution.ranks`: the venue of every rank of a torchrun job (``--parallel``); the
  job itself (:mod:`~autotune.execution.job`), the DDP/FSDP2 wrapper
  (:mod:`~autotune.training.wrapping`), the agreement rules (:mod:`~autotune.execution.agreement`)
  and the NCCL watch (:mod:`~autotune.execution.watch`).
* :mod:`~autotune.execution.trial`, :mod:`~autotune.execution.probe`: the trial and the probe
  candidate, each run here by a function and anywhere as a piece of work. The plan checks are the
  third piece of work (:mod:`autotune.execution.plan_check`).

May import :mod:`autotune.training`, :mod:`autotune.plans`, the meters and the records; never the
search, analysis or report layers (they call down into this one).
"""

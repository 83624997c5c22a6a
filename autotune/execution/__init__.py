"""Where and how a piece of work runs: a trial, a probe candidate, a plan check.

* :mod:`~autotune.execution.trial` and :mod:`~autotune.execution.probe`: the work itself, in this process.
* :mod:`~autotune.execution.spawn`: a piece of work in a fresh spawned worker process.
* :mod:`~autotune.execution.distributed`: a piece of work on every rank of a torchrun job.

May import :mod:`autotune.training`, :mod:`autotune.plans`, the meters and the records; never the
search, analysis or report layers (they call down into this one).
"""

"""The search: which configurations to try, the trial store they live in, and the loop that runs them.

* :mod:`~autotune.search.space`: precisions x checkpoint plans x batch sizes.
* :mod:`~autotune.search.strategies`: grid, auto (the memory model's bracket) and Optuna samplers.
* :mod:`~autotune.search.store`: the Optuna study as the trial store (identity, reuse, resume).
* :mod:`~autotune.search.peers`: claims and waiting, so that several workers share one study.
* :mod:`~autotune.search.loop`: :func:`~autotune.search.loop.run_search`, proposals to stored trials.

The space, the strategies and the store import no torch (the analysis side reads them); only the
loop imports the execution layer. Nothing here imports the report or the tuner.
"""

"""What one training step is: the user's workload, its data, the precision modes, the prepared model.

* :mod:`~autotune.training.workload`: the model factory, batches and loss (the workload protocol).
* :mod:`~autotune.training.data`: the dataset's item sizes and its worst batches.
* :mod:`~autotune.training.precision`: autocast and the GradScaler per precision mode.
* :mod:`~autotune.training.applied`: :func:`autotune.apply`, the one way a model is prepared for a
  configuration (trials, the probe and users alike).

May import :mod:`autotune.plans`, :mod:`autotune.records`, the meters and the device backend; never
the execution, search or report layers above it.
"""

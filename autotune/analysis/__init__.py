"""What the trials say: the Pareto front, each plan's batch limit, the recommendation, the memory model.

Plain arithmetic over :class:`~autotune.records.Measurement` values: no torch, no store. The
search's auto strategy asks the same functions where a limit lies; the report derives its front,
limits and recommendation from them.
"""

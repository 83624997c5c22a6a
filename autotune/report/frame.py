"""A report as a pandas DataFrame: one row per trial."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas

__all__ = ["TABLE_COLUMNS", "to_dataframe"]

TABLE_COLUMNS = ["precision", "segments", "compile", "batch_size", "status", "peak_bytes", "step_s", "samples_per_s"]


def to_dataframe(report: Any) -> "pandas.DataFrame":
    """One row per trial of a :class:`~autotune.report.Report`, with ``feasible``, ``pareto`` and ``recommended`` flags."""
    import pandas as pd

    pareto = {m.config for m in report.pareto}
    rec = report.recommendation
    rows = []
    for m in report.trials:
        row = {k: v for k, v in m.to_dict().items() if k not in ("step_times_s", "loss_scale_history", "plan")}
        row.update(feasible=m.fits(report.budget_bytes), pareto=m.config in pareto,
                   recommended=rec is not None and m.config == rec.config)
        rows.append(row)
    columns = TABLE_COLUMNS + [c for c in (rows[0] if rows else {}) if c not in TABLE_COLUMNS]
    return pd.DataFrame(rows, columns=columns)

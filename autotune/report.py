"""The result of a search: JSON with a versioned schema, a pandas DataFrame and a text table."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from typing import Any

import torch

from autotune.pareto import batch_limits, pareto_front, recommend
from autotune.trial import Measurement
from autotune.units import format_bytes

__all__ = ["SCHEMA_VERSION", "Report", "environment", "load"]

SCHEMA_VERSION = 1

TABLE_COLUMNS = ["precision", "segments", "batch_size", "status", "peak_bytes", "step_s", "samples_per_s"]


def environment(device: torch.device) -> dict[str, Any]:
    """Describe the machine the trials ran on."""
    import optuna

    from autotune import __version__

    env: dict[str, Any] = {
        "autotune_version": __version__,
        "torch_version": torch.__version__,
        "optuna_version": optuna.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_type": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            total_memory_bytes=props.total_memory,
            cuda_version=torch.version.cuda,
            compute_capability=f"{props.major}.{props.minor}",
        )
    else:
        env.update(device_name=_cpu_name(), total_memory_bytes=_ram_bytes(), cpu_count=os.cpu_count(),
                   torch_threads=torch.get_num_threads())
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything a search found; the Pareto front, limits and recommendation derive from the trials."""

    environment: dict[str, Any]
    workload: dict[str, Any]
    budget_bytes: int | None
    headroom: float
    search: dict[str, Any]
    trials: tuple[Measurement, ...]
    notices: tuple[str, ...] = ()

    @property
    def pareto(self) -> list[Measurement]:
        """Feasible trials not beaten on both throughput and peak memory, by ascending peak."""
        return pareto_front(self.trials, self.budget_bytes)

    @property
    def recommendation(self) -> Measurement | None:
        """The fastest trial whose peak fits within ``budget x (1 - headroom)``, or ``None``."""
        return recommend(self.trials, self.budget_bytes, self.headroom)

    @property
    def limits(self) -> list[dict]:
        """Per (precision, segments): ``max_batch_size`` that fits, and the smallest batch that did not."""
        return batch_limits(self.trials, self.budget_bytes)

    def to_dict(self) -> dict[str, Any]:
        recommendation = self.recommendation
        return {
            "schema_version": SCHEMA_VERSION,
            "environment": self.environment,
            "workload": self.workload,
            "budget_bytes": self.budget_bytes,
            "headroom": self.headroom,
            "search": self.search,
            "trials": [self._trial_dict(m) for m in self.trials],
            "limits": self.limits,
            "pareto": [self._trial_dict(m) for m in self.pareto],
            "recommendation": self._trial_dict(recommendation) if recommendation else None,
            "notices": list(self.notices),
        }

    def _trial_dict(self, m: Measurement) -> dict[str, Any]:
        return {**m.to_dict(), "feasible": m.fits(self.budget_bytes)}

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int = 2) -> str:
        """Return the report as JSON text; with ``path``, also write it there (atomically)."""
        text = json.dumps(self.to_dict(), indent=indent, allow_nan=False)
        if path is not None:
            path = os.fspath(path)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"unsupported schema_version {data.get('schema_version')!r} (this autotune reads {SCHEMA_VERSION})")
        return cls(
            environment=data["environment"],
            workload=data["workload"],
            budget_bytes=data["budget_bytes"],
            headroom=data["headroom"],
            search=data["search"],
            trials=tuple(Measurement.from_dict(t) for t in data["trials"]),
            notices=tuple(data.get("notices", ())),
        )

    def to_dataframe(self):
        """Return one row per trial (pandas), with ``feasible``, ``pareto`` and ``recommended`` flags."""
        import pandas as pd

        pareto = {m.config for m in self.pareto}
        rec = self.recommendation
        rows = []
        for m in self.trials:
            row = {k: v for k, v in m.to_dict().items() if k not in ("step_times_s", "loss_scale_history", "plan")}
            row.update(feasible=m.fits(self.budget_bytes), pareto=m.config in pareto,
                       recommended=rec is not None and m.config == rec.config)
            rows.append(row)
        columns = TABLE_COLUMNS + [c for c in (rows[0] if rows else {}) if c not in TABLE_COLUMNS]
        return pd.DataFrame(rows, columns=columns)

    def table(self) -> str:
        """Return a human-readable summary: every trial, the limits, the front and the recommendation."""
        lines = [f"{'precision':<9} {'segments':>8} {'batch':>6} {'status':<7} {'peak':>11} {'step_s':>8} {'samples/s':>10}  "]
        pareto = {m.config for m in self.pareto}
        rec = self.recommendation
        for m in self.trials:
            mark = "<- recommended" if rec is not None and m.config == rec.config else ("pareto" if m.config in pareto else "")
            step = f"{m.step_s:.4f}" if m.step_s is not None else "-"
            sps = f"{m.samples_per_s:.1f}" if m.samples_per_s is not None else "-"
            lines.append(
                f"{m.precision:<9} {m.segments:>8} {m.batch_size:>6} {m.status:<7} {format_bytes(m.peak_bytes):>11} "
                f"{step:>8} {sps:>10}  {mark}".rstrip()
            )
        lines.append("")
        lines.append("largest batch that fits, per precision and segments: " + ", ".join(
            f"{row['precision']}/{row['segments']}: {row['max_batch_size'] if row['max_batch_size'] is not None else 'none'}"
            for row in self.limits
        ))
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none"
        if rec is None:
            lines.append(f"recommendation: none fits within {budget} less {self.headroom:.0%} headroom")
        else:
            share = f" ({rec.peak_bytes / self.budget_bytes:.0%} of the {budget} budget)" if self.budget_bytes else ""
            lines.append(
                f"recommendation: {rec.precision}, segments {rec.segments}, batch size {rec.batch_size}: "
                f"{rec.samples_per_s:.1f} samples/s, peak {format_bytes(rec.peak_bytes)}{share}"
            )
        return "\n".join(lines)


def load(path: str | os.PathLike) -> Report:
    """Read a report written by :meth:`Report.to_json`."""
    with open(path) as f:
        return Report.from_dict(json.load(f))

"""Rewrite committed reports of an older schema in today's, their trials as they were measured.

    python benchmarks/migrate_results.py results/grid-TinyGPT-cpu.json results/grid-ResNetish-cpu.json

For a report whose measurements today's code would take the same way, where only the form changed: schema 4 to 5
added compiled training (``--compile``), and every trial of a schema 4 report trained eager, which a schema 5 trial
says as ``compile: none`` with no compile figures. The report is read (``autotune.load``), written again by
``Report.to_dict`` (its derived sections recomputed from its trials by today's analysis), and marked:
``migrated`` names the schema it was measured in and the autotune that measured it
(``environment.autotune_version`` is kept). Regenerating it with the command that made it replaces this: the grids
(``python benchmarks/claims.py --run``) take about 18 minutes on two quiet cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import autotune
from autotune.report import SCHEMA_VERSION

# Older schemas whose trials today's code measures the same way: the form changed, not what a figure means
SAME_MEASUREMENTS = {4}


def migrate(path: Path) -> dict:
    """The report at ``path`` in today's schema, marked as migrated (or as it is, when it is of today's schema)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    old = data["schema_version"]
    if old == SCHEMA_VERSION:
        return data
    if old not in SAME_MEASUREMENTS:
        raise SystemExit(f"{path}: schema {old} measured otherwise than today's code does: regenerate it instead")
    new = autotune.load(path).to_dict()
    new["migrated"] = {"from_schema": old, "measured_by": data["environment"].get("autotune_version"),
                       "by": "benchmarks/migrate_results.py",
                       "why": "schema 5 added compiled training; every trial of this report trained eager"}
    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path)
    for path in parser.parse_args().reports:
        path.write_text(json.dumps(migrate(path), indent=2) + "\n", encoding="utf-8")
        print(f"{path}: schema {SCHEMA_VERSION}")


if __name__ == "__main__":
    main()

"""Where the tests find the repository's files, wherever in ``tests/`` a test module lives."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository: results/, benchmarks/, docs/
DATA = ROOT / "tests" / "data"  # the tests' own files

"""The whole test suite as CI runs it, in one command: ``python3 -m tests [pytest arguments]``.

Two pytest runs, one after the other, each given the arguments:

1. every test not marked ``serial``, on two processes beside each other where pytest-xdist is installed (a module
   to a process, the slowest modules first: tests/conftest.py's SLOWEST_FIRST; pytest-benchmark, where a machine
   has it, errs beside xdist and is left out), else in one;
2. the tests marked ``serial`` (CPU hogs, searches stopped by a signal, parallel workers, distributed ranks), alone.

Both run whatever the first finds. The exit status is the first non-zero one, except that a run which collected
no test (pytest's 5, as a ``-k`` that selects only one kind gives) counts as passed when the other ran tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

NO_TESTS = 5  # pytest's exit status when it collected nothing


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", *argv]
    spread = ["-n", "2", "--dist", "loadscope", "-p", "no:benchmark"] if importlib.util.find_spec("xdist") else []
    statuses = [subprocess.call([*pytest, "-m", "not serial", *spread]), subprocess.call([*pytest, "-m", "serial"])]
    if all(status == NO_TESTS for status in statuses):
        return NO_TESTS
    return next((status for status in statuses if status not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

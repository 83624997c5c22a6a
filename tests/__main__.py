"""The test suite as CI runs it, in one command: ``python3 -m tests [--full] [pytest arguments]``.

Two pytest runs, one after the other, each given the arguments:

1. every test not marked ``serial``, on two processes beside each other where pytest-xdist is installed (a module
   to a process, the slowest modules first: tests/conftest.py's SLOWEST_FIRST; pytest-benchmark, where a machine
   has it, errs beside xdist and is left out), else in one;
2. the tests marked ``serial`` (CPU hogs, searches stopped by a signal, parallel workers, distributed ranks), alone.

Both leave out the full tier (marker ``full``, tests/conftest.py's FULL_TIER: the wider matrix and the longest
end-to-end runs, each beside a sibling that stays), to keep CI within its ten minutes on two cores; ``--full`` runs it
too. Both run whatever the first finds. The exit status is the first non-zero one, except that a run which collected
no test (pytest's 5, as a ``-k`` that selects only one kind gives) counts as passed when the other ran tests.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

NO_TESTS = 5  # pytest's exit status when it collected nothing


def main(argv: list[str]) -> int:
    full = "--full" in argv
    pytest = [sys.executable, "-m", "pytest", *(a for a in argv if a != "--full")]
    spread = ["-n", "2", "--dist", "loadscope", "-p", "no:benchmark"] if importlib.util.find_spec("xdist") else []
    tier = "" if full else " and not full"
    statuses = [subprocess.call([*pytest, "-m", f"not serial{tier}", *spread]),
                subprocess.call([*pytest, "-m", f"serial{tier}"])]
    if all(status == NO_TESTS for status in statuses):
        return NO_TESTS
    return next((status for status in statuses if status not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The suite passes whatever order its modules run in: the two modules that change torch's global configuration the
most (the allocator meter's and compile's, both set inductor's settings for their compiles) run in one process, in
both orders, as the README's test command may run them. tests/conftest.py's module fixture checks every module puts
torch's configuration back; this runs the pair that broke when one did not."""

import os
import subprocess
import sys

import pytest

from tests.paths import ROOT

PAIR = ["tests/meters/test_allocator_meter.py", "tests/training/test_compile.py"]


@pytest.mark.parametrize("order", [PAIR, PAIR[::-1]], ids=["allocator-then-compile", "compile-then-allocator"])
def test_the_modules_that_compile_pass_in_one_process_in_either_order(order):
    # one process of its own, whether this test runs in one or on pytest-xdist's (whose variables it leaves behind:
    # pytest-benchmark, where installed, refuses to start beside xdist)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:benchmark", "-p",
                           "no:cacheprovider", "-m", "not full", *order], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]

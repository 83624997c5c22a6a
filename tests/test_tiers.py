"""CI's tier and the full tier (tests/conftest.py's FULL_TIER): every entry names tests that exist, so that a test
renamed or removed cannot leave an entry that no longer marks anything (nor one that marks nothing it meant to)."""

import subprocess
import sys
from pathlib import Path

from tests.conftest import FULL_TIER, in_full_tier, matches

ROOT = Path(__file__).resolve().parent.parent


def test_every_full_tier_entry_names_collected_tests_and_ci_keeps_the_rest():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:benchmark", "-p",
                           "no:randomly", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids, done.stdout[-2000:] + done.stderr[-2000:]
    unmatched = [entry for entry in FULL_TIER if not any(matches(i, entry) for i in ids)]
    assert not unmatched, unmatched
    full = [i for i in ids if in_full_tier(i)]
    assert 0 < len(full) < len(ids) // 10  # a tier beside CI's, not instead of it

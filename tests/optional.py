"""Optional test dependencies: one way for every test to say what it needs.

``needs("lightning")`` returns the imported module, or skips the calling test (or module, at module level) with
the reason when it does not import. When ``AUTOTUNE_TEST_REQUIRE`` (comma-separated) names the package, it fails
instead: CI names every optional package it installs (.ci/run), so a broken install fails there rather than
skipping quietly; a developer without the extras sees skips that say what to install.

Any exception counts as "does not import", not only ImportError: timm imports torchvision, whose PyPI build does
not load beside the CPU build of torch (a RuntimeError, which ``pytest.importorskip`` would not catch); CI runs
the timm tests in a second environment with ``AUTOTUNE_TEST_REQUIRE=timm``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def required() -> set[str]:
    """The packages ``AUTOTUNE_TEST_REQUIRE`` names: a test that needs one fails where it does not import."""
    return {name.strip() for name in os.environ.get("AUTOTUNE_TEST_REQUIRE", "").split(",") if name.strip()}


def needs(module: str, why: str = "") -> ModuleType:
    """Import and return ``module`` (``"accelerate.state"`` too); skip, or fail when required, where it does not import.

    ``why`` says what the package is for, in the skip's reason. The package is the module's first dotted part.
    """
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - torchvision's mismatch is a RuntimeError, not an ImportError
        reason = f"optional test dependency {package} does not import here: {type(exc).__name__}: {exc}"
        if why:
            reason += f" ({why})"
        if package in required():
            pytest.fail(reason + " (and AUTOTUNE_TEST_REQUIRE names it)", pytrace=False)
        pytest.skip(reason, allow_module_level=True)

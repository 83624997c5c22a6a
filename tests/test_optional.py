"""The tests' own mechanism for optional packages (tests/optional.py): skip with the reason, or fail when required."""

import pytest

from tests.optional import needs, required


def test_a_missing_package_skips_with_the_reason(monkeypatch):
    monkeypatch.delenv("AUTOTUNE_TEST_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_package_xyz does not import here.*ModuleNotFoundError.*"
                                                    r"\(the plot extra\)"):
        needs("no_such_package_xyz.sub", "the plot extra")


def test_a_required_package_that_is_missing_fails(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TEST_REQUIRE", "timm, no_such_package_xyz")
    assert required() == {"timm", "no_such_package_xyz"}
    with pytest.raises(pytest.fail.Exception, match="AUTOTUNE_TEST_REQUIRE names it"):
        needs("no_such_package_xyz")


def test_a_package_that_raises_on_import_counts_as_missing(monkeypatch, tmp_path):
    # as timm does where torchvision was built for another torch: a RuntimeError, not an ImportError
    (tmp_path / "broken_package_xyz.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("AUTOTUNE_TEST_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="RuntimeError: operator torchvision::nms"):
        needs("broken_package_xyz")


def test_a_package_that_imports_is_returned():
    assert needs("json").dumps([]) == "[]" and needs("os.path").join("a", "b") == "a/b"

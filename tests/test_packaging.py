"""pyproject.toml tells the truth: the interpreter running the tests satisfies requires-python and is one of the
classifiers' versions, the classifiers start at the floor, and every package autotune imports is declared.

The few fields are read with regular expressions, so the test runs the same on every Python that requires-python
admits (tomllib is 3.11+), and one test checks that reading against a real TOML parser (tomllib, or tomli, which
pytest brings before 3.11). Needs no torch.
"""

from __future__ import annotations

import ast
import importlib.metadata
import operator
import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
# a module autotune imports that only an extra provides: the extra
# Modules imported only by optional parts of autotune, and the extra that brings each
OPTIONAL_IMPORTS = {"matplotlib": "plot", "transformers": "hf", "accelerate": "hf", "lightning": "frameworks",
                    "timm": "timm", "peft": "peft"}
_CLASSIFIER = re.compile(r"^Programming Language :: Python :: (\d+)\.(\d+)$")
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq,
        "!=": operator.ne}


def _strip_comments(text: str) -> str:
    """The TOML without its comments (a '#' outside a double-quoted string starts one)."""
    lines = []
    for line in text.split("\n"):
        quoted, cut = False, len(line)
        for i, ch in enumerate(line):
            if ch == '"':
                quoted = not quoted
            elif ch == "#" and not quoted:
                cut = i
                break
        lines.append(line[:cut])
    return "\n".join(lines)


def _table(text: str, name: str) -> str:
    match = re.search(rf"^\[{re.escape(name)}\][ \t]*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"pyproject.toml has no [{name}] table"
    return match.group(1)


def _string_list(table: str, key: str) -> List[str]:
    """The strings of the array ``key = [...]`` (a ']' inside a string, as in "pkg[extra]", does not end it)."""
    match = re.search(rf"^{re.escape(key)}\s*=\s*\[", table, re.MULTILINE)
    if not match:
        return []
    items = re.compile(r'\s*(?:"([^"]*)"\s*,?)')
    found, at = [], match.end()
    while True:
        item = items.match(table, at)
        if not item:
            break
        found.append(item.group(1))
        at = item.end()
    assert re.match(r"\s*\]", table[at:]), f"pyproject.toml: {key} is not a plain array of strings"
    return found


def read_pyproject(text: str) -> Dict[str, object]:
    """requires-python, classifiers, dependencies and optional-dependencies of a pyproject.toml."""
    text = _strip_comments(text)
    project = _table(text, "project")
    requires = re.search(r'^requires-python\s*=\s*"([^"]*)"', project, re.MULTILINE)
    extras_table = _table(text, "project.optional-dependencies")
    extras = {key: _string_list(extras_table, key)
              for key in re.findall(r"^([A-Za-z0-9_-]+)\s*=", extras_table, re.MULTILINE)}
    return {"requires-python": requires.group(1) if requires else None,
            "classifiers": _string_list(project, "classifiers"),
            "dependencies": _string_list(project, "dependencies"),
            "optional-dependencies": extras}


def _version(text: str) -> Tuple[int, ...]:
    assert re.fullmatch(r"\d+(\.\d+)*", text), f"not a plain version: {text!r}"
    return tuple(int(part) for part in text.split("."))


def satisfies(version: Tuple[int, ...], specifier: str) -> bool:
    """Whether ``version`` (major, minor[, micro]) meets a requires-python specifier such as '>=3.10,<4'; the
    comparison pads the shorter with zeros, as PEP 440 does for release numbers."""
    for clause in specifier.split(","):
        match = re.fullmatch(r"\s*(>=|<=|==|!=|>|<)\s*([\d.]+)\s*", clause)
        assert match, f"unsupported requires-python clause {clause!r}"
        bound = _version(match.group(2))
        width = max(len(bound), len(version))
        padded = tuple(version) + (0,) * (width - len(version))
        if not _OPS[match.group(1)](padded, bound + (0,) * (width - len(bound))):
            return False
    return True


def python_classifiers(classifiers: List[str]) -> List[Tuple[int, int]]:
    return sorted((int(m.group(1)), int(m.group(2))) for m in map(_CLASSIFIER.match, classifiers) if m)


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()


def third_party_imports(package: Path) -> Dict[str, List[str]]:
    """Top-level modules outside the standard library that the package's modules import: module -> importing files.
    ``_require("name")`` (autotune.thirdparty's import of an optional package) counts as an import."""
    found: Dict[str, List[str]] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_require"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != package.name and top not in sys.stdlib_module_names:
                    found.setdefault(top, []).append(str(path.relative_to(package.parent)))
    return found


@pytest.fixture(scope="module")
def pyproject():
    return read_pyproject(PYPROJECT.read_text(encoding="utf-8"))


def test_the_reading_agrees_with_a_toml_parser(pyproject):
    try:
        import tomllib
    except ImportError:  # before 3.11: pytest itself depends on tomli there
        import tomli as tomllib
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    assert pyproject == {key: project.get(key, [] if key != "requires-python" else None)
                         for key in ("requires-python", "classifiers", "dependencies", "optional-dependencies")}


def test_this_interpreter_satisfies_requires_python(pyproject):
    assert pyproject["requires-python"], "pyproject.toml sets no requires-python"
    assert satisfies(sys.version_info[:3], pyproject["requires-python"]), (
        f"Python {sys.version.split()[0]} is outside requires-python {pyproject['requires-python']!r}")


def test_the_classifiers_list_this_interpreter(pyproject):
    assert sys.version_info[:2] in python_classifiers(pyproject["classifiers"]), (
        f"no 'Programming Language :: Python :: {sys.version_info[0]}.{sys.version_info[1]}' classifier")


def test_the_classifiers_start_at_the_floor_and_leave_no_gap(pyproject):
    versions = python_classifiers(pyproject["classifiers"])
    assert versions, "no 'Programming Language :: Python :: 3.x' classifiers"
    assert all(satisfies(v, pyproject["requires-python"]) for v in versions), "a classifier below requires-python"
    floor = versions[0]
    assert not satisfies((floor[0], floor[1] - 1, 99), pyproject["requires-python"]), (
        f"requires-python admits Pythons before {floor[0]}.{floor[1]}, the first classifier")
    assert versions == [(floor[0], floor[1] + i) for i in range(len(versions))], "a gap in the classifiers"


def test_every_package_autotune_imports_is_declared(pyproject):
    core = {_name(r) for r in pyproject["dependencies"]}
    extras = {extra: {_name(r) for r in reqs} for extra, reqs in pyproject["optional-dependencies"].items()}
    providers = importlib.metadata.packages_distributions()
    missing = []
    for module, files in third_party_imports(ROOT / "autotune").items():
        names = {_name(d) for d in providers.get(module, [module])}
        declared = extras.get(OPTIONAL_IMPORTS[module], set()) if module in OPTIONAL_IMPORTS else core
        if not names & declared:
            where = f"extra {OPTIONAL_IMPORTS[module]!r}" if module in OPTIONAL_IMPORTS else "dependencies"
            missing.append(f"{module} ({', '.join(sorted(names))}), imported by {', '.join(sorted(set(files)))}: "
                           f"not in {where}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("version, specifier, expected", [
    ((3, 10, 0), ">=3.10", True), ((3, 9, 18), ">=3.10", False), ((3, 14, 1), ">=3.10,<3.15", True),
    ((3, 15, 0), ">=3.10,<3.15", False), ((3, 11, 7), "==3.11", False), ((3, 11), "==3.11", True),
    ((3, 10, 99), ">3.10", True), ((3, 10), "!=3.10", False),
])
def test_requires_python_is_read_as_pep_440_reads_it(version, specifier, expected):
    assert satisfies(version, specifier) is expected


def test_the_reading_sees_what_a_pyproject_says():
    text = '''[project]
name = "x"  # a comment with "quotes"
requires-python = ">=3.10"  # why
classifiers = [
    "Programming Language :: Python :: 3.11",  # tested
    "Programming Language :: Python :: 3.10",
]
dependencies = ["numpy>=1.21", "Foo_Bar[x]>=1"]

[project.optional-dependencies]
plot = ["matplotlib>=3.5"]  # --plot
test = [
    "pytest>=7",
]

[tool.x]
classifiers = ["Programming Language :: Python :: 2.7"]
'''
    read = read_pyproject(text)
    assert read == {"requires-python": ">=3.10",
                    "classifiers": ["Programming Language :: Python :: 3.11", "Programming Language :: Python :: 3.10"],
                    "dependencies": ["numpy>=1.21", "Foo_Bar[x]>=1"],
                    "optional-dependencies": {"plot": ["matplotlib>=3.5"], "test": ["pytest>=7"]}}
    assert python_classifiers(read["classifiers"]) == [(3, 10), (3, 11)]
    assert [_name(r) for r in read["dependencies"]] == ["numpy", "foo-bar"]


def test_the_package_says_the_version_its_metadata_does():
    from autotune._version import __version__

    import autotune

    assert autotune.__version__ == __version__ == importlib.metadata.version("autotune")
    assert re.fullmatch(r"0\.(\d+)\.\d+", __version__)

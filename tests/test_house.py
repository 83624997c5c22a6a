"""The package's shape: short functions and modules, no import cycle, and an analysis side that runs without torch."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "autotune"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450


def _modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), filename=str(path))
    return modules


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The autotune modules ``name`` imports anywhere: inside functions and under ``if TYPE_CHECKING`` too."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from autotune.meters import cuda" imports a submodule; "from autotune.x import name" the module x
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_module_is_longer_than_450_lines():
    long = [f"{path.relative_to(PACKAGE.parent)} ({len(path.read_text().splitlines())} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) if len(path.read_text().splitlines()) > MAX_MODULE_LINES]
    assert not long, long


def test_no_function_is_longer_than_60_lines():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, tree in _modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_there_is_no_import_cycle_lazy_or_not():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_cycle_finder_finds_a_lazy_cycle_and_a_type_checking_one():
    a = ast.parse("def f():\n    from autotune.b import g\n")
    b = ast.parse("import autotune.a\n")
    c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autotune.a import A\n")
    assert _imports("autotune.a", a, {"autotune.a", "autotune.b"}) == {"autotune.b"}
    assert _imports("autotune.b", b, {"autotune.a", "autotune.b"}) == {"autotune.a"}
    assert _imports("autotune.c", c, {"autotune.a", "autotune.c"}) == {"autotune.a"}


def _python(code: str, *, without_torch: bool) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository's root; ``without_torch``: importing torch fails there."""
    prefix = "import sys; sys.modules['torch'] = None\n" if without_torch else ""
    out = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    return out


@pytest.mark.parametrize("modules", [
    "autotune.analysis.pareto, autotune.analysis.memory_model, autotune.search.strategies",
    "autotune.report, autotune.records, autotune.options, autotune.search.store, autotune.plot, autotune.export",
    "autotune.plans, autotune.cli.parser, autotune.cli.table, autotune.cli.progress, autotune.report.frame",
    "autotune",
])
def test_the_analysis_side_imports_without_torch(modules):
    # Importing torch fails in that interpreter: these modules must not even try.
    _python(f"import {modules}\n"
            "assert not any(m.startswith('torch.') for m in sys.modules if sys.modules[m] is not None)\n",
            without_torch=True)


def test_a_report_is_read_and_analysed_without_torch():
    out = _python("import autotune\n"
                  "r = autotune.load('tests/data/quickstart-v1.json')\n"
                  "assert r.recommendation is not None and r.pareto and r.memory_model.lines\n"
                  "print(r.table().splitlines()[-1])\n", without_torch=True)
    assert out.stdout.startswith("recommendation:")


def test_the_training_names_load_on_first_use():
    _python("import sys, autotune\n"
            "assert 'torch' not in sys.modules\n"
            "tune, apply = autotune.tune, autotune.apply\n"
            "assert 'torch' in sys.modules and callable(tune) and callable(apply)\n"
            "import autotune.training.applied, autotune.execution.trial\n"
            "assert autotune.apply is autotune.training.applied.apply  # the function, not a module of that name\n"
            "assert set(autotune.__all__) <= set(dir(autotune))\n", without_torch=False)

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


# The floors of the house, bottom up. A part (a top-level module or package of autotune) imports parts on its own
# floor or below, never above: the ground floor holds the words every floor uses and imports no part of ours above it.
FLOORS = (
    ("_version", "_log", "errors", "signals", "units", "vocabulary", "thirdparty"),  # the ground floor, no torch
    ("records", "meters"),  # the values every stage passes on; how memory is measured
    ("analysis", "device", "timing"),  # front, limits and memory lines from records; the device backend; step time
    # from an op's work (the cards' data sheets, this machine calibrated)
    ("report", "plans"),  # a search's result and its JSON; checkpoint plans applied to a model
    ("training",),  # one training step: workload, data, precision, the prepared and wrapped model
    ("execution",),  # where a piece of work runs: this process, a worker, every rank; trials, probe, plan checks
    ("search",),  # the trial store, the strategies, the search loop
    ("options",),  # one tuning run's flags, checked
    ("preparation", "dry_run"),  # the tuner's first stages; the dry run's predictions
    ("tuner", "refine", "eval_limits", "cli", "export", "plot"),  # the pipeline, its stages after the analysis (refine,
    # eval_limits); the command line's words; what a report is turned into
    ("integrations", "__main__", "examples"),  # the trainers' entry points, the command, the bundled models
)


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "autotune"


def _part_edges() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the module imports that make the edge; the package's own __init__ aside."""
    modules = _modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for name, tree in modules.items():
        for target in _imports(name, tree, set(modules)):
            a, b = _part(name), _part(target)
            if a != b and "autotune" not in (a, b):
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return edges


def test_every_part_stands_on_a_floor_and_imports_none_above_it():
    floor = {part: i for i, parts in enumerate(FLOORS) for part in parts}
    parts = {_part(name) for name in _modules()} - {"autotune"}
    assert parts == set(floor), f"parts without a floor: {sorted(parts - set(floor))}; floors without a part: " \
                                f"{sorted(set(floor) - parts)}"
    upward = [f"{a} (floor {floor[a]}) -> {b} (floor {floor[b]}): {how}" for (a, b), how in sorted(_part_edges().items())
              if floor[b] > floor[a]]
    assert not upward, upward


def test_no_two_parts_import_each_other_lazy_or_not():
    graph: dict[str, set[str]] = {}
    for a, b in _part_edges():
        graph.setdefault(a, set()).add(b)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    knots = sorted({tuple(sorted((a, b))) for a, b in _part_edges() if reaches(b, a)})
    assert not knots, [f"{a} <-> {b}" for a, b in knots]


def _literal_compares(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines comparing a value called one of ``names`` (a name, an attribute, or ``.get("name")``) with a string literal
    (``m.status == "ok"``, ``status in ("ok", "oom")``, ``d.get("wrapper") == "ddp"``)."""
    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in names
        return isinstance(node, ast.Name) and node.id in names or isinstance(node, ast.Attribute) and node.attr in names

    def literal(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) or isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) and any(literal(e) for e in node.elts)

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(named(a) and literal(b) or literal(a) and named(b)
                    for a, b in zip([node.left, *node.comparators], node.comparators))]


def test_statuses_are_compared_as_members_of_their_enum_not_as_strings():
    found = [f"{name}:{line}" for name, tree in _modules().items() for line in _literal_compares(tree, {"status"})]
    assert not found, found
    assert _literal_compares(ast.parse("ok = m.status == 'ok' or status in ('oom', 'timeout')"), {"status"}) == [1, 1]


# Names whose values are a ground-floor vocabulary (autotune.vocabulary.modes): compared as members, never as strings
_MODE_NAMES = {"parallel", "wrapper", "isolation", "default_isolation"}


def test_parallel_and_isolation_modes_are_compared_as_members_of_their_enums():
    found = [f"{name}:{line}" for name, tree in _modules().items() if not name.startswith("autotune.vocabulary")
             for line in _literal_compares(tree, _MODE_NAMES)]
    assert not found, found
    code = "a = job.wrapper == 'fsdp' or parallel != 'none' or d.get('wrapper') == 'ddp'"
    assert _literal_compares(ast.parse(code), _MODE_NAMES) == [1, 1, 1]


# Modules whose strings spell the vocabulary's words in another vocabulary: the time model's number formats (an op's
# dtype, a card's peak per dtype), and the words other libraries take (Hugging Face's TrainingArguments flags bf16 and
# fp16 and its fsdp argument, DeepSpeed's config keys, accelerate's and Lightning's precision and strategy settings).
# A compare of a precision with a string is refused everywhere (test_precisions_are_compared_as_members_...).
_OTHER_VOCABULARIES = ("autotune.timing", "autotune.export", "autotune.integrations.transformers")


def _vocabulary_words() -> set[str]:
    """The ground floor's words that no other floor spells: precision modes, torch.compile's named modes, the parallel
    wrappers and the worker isolation ("none" and "default" mean too many other things to be told apart)."""
    from autotune.vocabulary import COMPILE_MODES, DEFAULT, EAGER, PRECISION_NAMES, Isolation, Parallel

    modes = {m.value for m in (*Parallel, *Isolation)} - {"none", "auto"}
    return {*PRECISION_NAMES, *(set(COMPILE_MODES) - {EAGER, DEFAULT}), *modes}


def _vocabulary_literals(tree: ast.Module, words: set[str]) -> list[int]:
    """Lines of a string constant that is one of ``words``, docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and node.value in words and id(node) not in docstrings)


def test_the_vocabularys_words_are_spelled_on_the_ground_floor_only():
    words = _vocabulary_words()
    found = [f"{name}:{line}" for name, tree in _modules().items()
             if not name.startswith(("autotune.vocabulary", *_OTHER_VOCABULARIES))
             for line in _vocabulary_literals(tree, words)]
    assert not found, found  # vocabulary.PrecisionName.BF16, Parallel.FSDP: not "bf16", "fsdp"
    assert {"bf16-true", "max-autotune", "fsdp", "process"} <= words and "none" not in words
    code = '"""fp32 here is a word."""\nmode = "bf16-true"\nx = "bf16x"\nw = "ddp"'
    assert _vocabulary_literals(ast.parse(code), words) == [2, 4]


def test_precisions_are_compared_as_members_of_their_enum_not_as_strings():
    found = [f"{name}:{line}" for name, tree in _modules().items() if not name.startswith("autotune.vocabulary")
             for line in _literal_compares(tree, {"precision"})]
    assert not found, found


# Functions whose tuples a contract fixes: the model's (input, target) batch, a forward pre-hook's (args, kwargs),
# torch.utils.checkpoint's context_fn (two context managers), torch.cuda's (major, minor) capability, and the tensor
# meter's allocation trace, (bytes, key) events by the million, which the cuBLAS workspaces' events join
_CONTRACT_TUPLES = {"example_batch", "hook", "restore_buffers", "selective_contexts", "parse_capability",
                    "workspace_trace"}


def _positional_tuples(tree: ast.Module) -> list[str]:
    """Public functions and methods (not nested ones: those stay in their module) that give back a fixed-length tuple:
    annotated ``tuple[A, B]`` (or ``tuple[A, B] | None``), or returning a tuple display of two or more values."""
    def fixed(annotation: ast.AST | None) -> bool:
        for node in ast.walk(annotation) if annotation is not None else ():
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "tuple":
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                if len(elts) >= 2 and not (isinstance(elts[-1], ast.Constant) and elts[-1].value is Ellipsis):
                    return True
        return False

    def returns_pairs(fn: ast.AST) -> bool:
        todo = list(ast.iter_child_nodes(fn))
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue  # a nested function's returns are its own
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) >= 2:
                return True
            todo.extend(ast.iter_child_nodes(node))
        return False

    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    functions += [m for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                  for m in c.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f"{fn.name}:{fn.lineno}" for fn in functions if not fn.name.startswith("_")
            and fn.name not in _CONTRACT_TUPLES and (fixed(fn.returns) or returns_pairs(fn))]


def test_no_positional_tuple_crosses_a_module():
    """What a public function gives back is a record with names (a frozen dataclass), not a tuple read by position."""
    found = [f"{name}:{where}" for name, tree in _modules().items() for where in _positional_tuples(tree)]
    assert not found, found
    code = ("def a() -> tuple[int, str]: ...\ndef b() -> tuple[int, ...] | None: ...\ndef c(x):\n    return x, 1\n"
            "def d():\n    def e():\n        return 1, 2\n    return e\nclass F:\n    def g(self) -> tuple[int, int] | None: ...")
    assert _positional_tuples(ast.parse(code)) == ["a:1", "c:3", "g:10"]


def test_the_cycle_finder_finds_a_lazy_cycle_and_a_type_checking_one():
    a = ast.parse("def f():\n    from autotune.b import g\n")
    b = ast.parse("import autotune.a\n")
    c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autotune.a import A\n")
    assert _imports("autotune.a", a, {"autotune.a", "autotune.b"}) == {"autotune.b"}
    assert _imports("autotune.b", b, {"autotune.a", "autotune.b"}) == {"autotune.a"}
    assert _imports("autotune.c", c, {"autotune.a", "autotune.c"}) == {"autotune.a"}


# Run first in the interpreter ``without_torch``: every attempt to import torch (or a torch.* module) is recorded and
# fails, as where torch is not installed; at exit, any attempt at all fails the run, even one the code caught and
# lived without (an optional import would still cost torch's import time where torch is installed).
_NO_TORCH = """\
import atexit, importlib.abc, os, sys
tried = []
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            tried.append(name)
            raise ImportError(f"no torch here: {name}")
sys.meta_path.insert(0, _NoTorch())
def _tried():
    if tried or "torch" in sys.modules:
        sys.stderr.write(f"torch was imported or tried: {tried}\\n")
        sys.stderr.flush()
        os._exit(3)
atexit.register(_tried)
"""


def _python(code: str, *, without_torch: bool) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter at the repository's root; ``without_torch``: no attempt to import torch."""
    out = subprocess.run([sys.executable, "-c", (_NO_TORCH if without_torch else "") + code], capture_output=True,
                         text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    return out


def test_the_torch_blocker_catches_a_caught_import():
    out = subprocess.run([sys.executable, "-c", _NO_TORCH + "try:\n    import torch.nn\nexcept ImportError:\n    pass\n"],
                         capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 3 and "torch was imported or tried: ['torch']" in out.stderr, out


@pytest.mark.parametrize("modules, use", [
    ("autotune.analysis.pareto, autotune.analysis.memory_model, autotune.search.strategies", ""),
    ("autotune.plans, autotune.cli.parser, autotune.report.table, autotune.cli.progress, autotune.report.frame",
     "from autotune.plans import Plan\nassert Plan('every2').blocks(4) == (0, 2)\n"),
    ("autotune.report, autotune.records, autotune.options, autotune.search.store, autotune.plot, autotune.export",
     # reading a measurement back, non-finite losses included
     "from autotune.records import Measurement, Config\n"
     "m = Measurement.from_dict(Measurement(Config('fp32', 2, 4), 'ok', loss_first=float('nan')).to_dict())\n"
     "assert m.segments == '2'\n"),
    ("autotune.errors",
     # the predicates go by names and messages: no torch to tell an OOM or a crash
     "from autotune.errors import is_oom, is_device_crash, first_line, UsageError\n"
     "assert is_oom(RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB'))\n"
     "assert not is_oom(RuntimeError('shapes'))\n"
     "assert is_device_crash(RuntimeError('CUDA error: an illegal memory access was encountered'))\n"
     "assert first_line(UsageError('a\\nb')) == 'a'\n"),
    ("autotune.timing.cards, autotune.timing.model",
     "from autotune.timing.cards import card\nfrom autotune.timing.model import card_machine\n"
     "assert card_machine(card('h100-sxm')).name == 'h100-sxm'\n"),
    ("autotune", ""),
], ids=["analysis", "plans-and-cli", "report-and-records", "errors", "timing", "autotune"])
def test_the_analysis_side_imports_and_works_without_torch(modules, use):
    # No attempt to import torch, in the import or in the use: these modules must not even try.
    _python(f"import {modules}\n{use}", without_torch=True)


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


def _imported_by_tests() -> set[str]:
    """The autotune modules some test imports: by name, or through a package a name it imports lives in."""
    import importlib
    import importlib.util
    import types

    seen: set[str] = set()
    for path in sorted((PACKAGE.parent / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                seen.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("autotune"):
                seen.add(node.module)
                module = importlib.import_module(node.module)
                for alias in node.names:
                    value = getattr(module, alias.name, None)
                    if value is None and importlib.util.find_spec(f"{node.module}.{alias.name}") is not None:
                        value = importlib.import_module(f"{node.module}.{alias.name}")  # a submodule not yet loaded
                    seen.add(value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", ""))
    return seen


def test_every_module_is_imported_by_some_test():
    seen = _imported_by_tests()
    modules = set(_modules())
    # a package counts where one of its modules is imported (its __init__ holds their names)
    missing = sorted(m for m in modules if m not in seen and not any(s.startswith(m + ".") for s in seen))
    assert not missing, missing


# Test modules at tests/'s top that test the whole (the house's rules, the docs, the tiers, packaging, the zoo, the
# published rows, the optional packages), not one module of the package
_WHOLE = {"house", "docs", "tiers", "packaging", "end_to_end", "zoo", "published", "optional", "order"}


def test_the_tests_are_shaped_like_the_package():
    tests = PACKAGE.parent / "tests"
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= subpackages, folders - subpackages  # tests/search/ tests autotune/search/, and so on
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    modules = {p.stem.lstrip("_") for p in PACKAGE.glob("*.py")}
    assert top - _WHOLE <= modules, top - _WHOLE - modules  # tests/test_tuner.py tests autotune/tuner.py

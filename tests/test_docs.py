"""The docs: every relative link of README.md and docs/ resolves (a ``#anchor`` into a Markdown file to one of its
headings, by GitHub's rules), the README stays a short front page, its quick start's test command is the one CI
runs, the flag reference has every flag of ``python -m autotune --help``, every include block holds its result
file as it is now and every figure tagged with its file and key reads as the file says (benchmarks/sync_docs.py).
Needs no torch."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HTML_TARGET = re.compile(r"<(?:a|img)\b[^>]*?\s(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
_HTML_ID = re.compile(r"<a\b[^>]*?\s(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")


def doc_pages(root: Path = ROOT) -> List[Path]:
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def _prose_lines(text: str, blank_code: bool = True) -> List[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked out unless ``blank_code`` is
    false (a heading keeps the text of its code spans)."""
    lines, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line) if blank_code else line))
    return lines


def links(text: str) -> List[Tuple[int, str]]:
    """(line number, target) of every Markdown link, image, reference definition and HTML href/src in prose."""
    found = []
    for number, line in _prose_lines(text):
        for pattern in (_INLINE_LINK, _REFERENCE, _HTML_TARGET):
            found += [(number, m.group(1)) for m in pattern.finditer(line)]
    return found


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lowercase, punctuation other than '-' and '_' dropped,
    each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "").lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in "-_ ").replace(" ", "-")


def anchors(text: str) -> Set[str]:
    """Every anchor a page has: its headings' slugs (the second of a name gets '-1', the third '-2', ...) and the
    names and ids of its HTML anchors."""
    seen: Dict[str, int] = {}
    found = set()
    for _, line in _prose_lines(text, blank_code=False):
        heading = _HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
        found.update(m.group(1) for m in _HTML_ID.finditer(line))
    return found


def broken_links(page: Path, root: Path = ROOT) -> List[str]:
    """One line per relative link of ``page`` that leaves the repository, names no file, or names an anchor its
    Markdown file does not have."""
    broken = []
    text = page.read_text(encoding="utf-8")
    for number, target in links(text):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        resolved = (page.parent / path).resolve() if path else page.resolve()
        if not resolved.is_relative_to(root.resolve()):
            broken.append(f"{where}: leaves the repository")
        elif not resolved.exists():
            broken.append(f"{where}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors_of(resolved):
            broken.append(f"{where}: {resolved.relative_to(root.resolve())} has no heading '#{anchor}'")
    return broken


def _anchors_of(path: Path) -> Set[str]:
    return anchors(path.read_text(encoding="utf-8"))


def _sync_docs():
    spec = importlib.util.spec_from_file_location("sync_docs", ROOT / "benchmarks" / "sync_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the repository's docs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = broken_links(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_docs_pages_exist_and_the_readme_links_to_every_one():
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) > 1
    targets = {(ROOT / t.partition("#")[0]).resolve() for _, t in links((ROOT / "README.md").read_text("utf-8"))}
    assert [p for p in pages if (ROOT / p).resolve() not in targets] == []


def test_the_readme_is_a_short_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/"


def test_the_readmes_test_command_is_what_ci_runs():
    """CI installs the same torch and extras as the quick start's test command, in a virtual environment there, then
    runs the same command (``python3 -m tests``: every test, the serial ones alone after the rest)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = next(line for line in readme.split("\n") if "pip install" in line and "-m tests" in line)
    steps = [step.strip() for step in command.split(" && ")]
    assert steps[0].startswith("python3 -m venv ") and steps[1].startswith(". ") and "/bin/activate" in steps[1]
    install, run = next(s for s in steps if s.startswith("pip install")), steps[-1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_install = next(line for line in ci.split("\n") if "pip install" in line and "torch==" in line and "-e" in line)
    wanted = [w for w in shlex.split(install) if w.startswith("torch==") or w == "-e" or w.startswith(".")]
    got = [w for w in shlex.split(ci_install) if w.startswith("torch==") or w == "-e" or w.startswith(".")]
    assert got == wanted
    calls = [line.split(" ||")[0].strip() for line in ci.split("\n")
             if line.strip().startswith("python3 -m ") and " pip " not in line]
    assert run == "python3 -m tests" and calls == [run], calls


def test_the_quick_start_spells_python_one_way():
    """The quick start's commands say python3 throughout (a fresh Debian has no ``python``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme[readme.index("## Quick start"):readme.index("## The command line at a glance")]
    blocks = re.findall(r"```\n(.*?)```", start, re.DOTALL)
    assert blocks and not [b for b in blocks if re.search(r"(?<![\w.])python(?!3)", b)], blocks


def test_the_flag_reference_has_every_flag():
    """Every flag ``python -m autotune --help`` and ``python -m autotune show --help`` print has a row in
    docs/usage.md's flag table."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    helps = [subprocess.run([sys.executable, "-m", "autotune", *args, "--help"], cwd=ROOT, env=env, check=True,
                            capture_output=True, text=True, timeout=120).stdout for args in ([], ["show"])]
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", "\n".join(helps))) - {"--help"}
    rows = [line.split("|")[1] for line in (ROOT / "docs" / "usage.md").read_text("utf-8").split("\n")
            if line.startswith("| `--")]
    documented = set(re.findall(r"`(--[a-z][a-z0-9-]*)", "\n".join(rows)))
    assert "--parallel" in flags
    assert sorted(flags - documented) == []


def test_every_include_block_matches_its_result_file():
    stale = _sync_docs().check(ROOT)
    assert not stale, "run python benchmarks/sync_docs.py:\n" + "\n".join(stale)


def test_the_docs_include_result_files_by_block():
    """The tables of results/*.md reach the docs only through include blocks."""
    sync = _sync_docs()
    included = {b.source for page in sync.pages(ROOT) for b in sync.blocks(page)}
    assert {"results/claims-cpu.md", "results/search_efficiency-cpu.md", "results/selective-cpu.md",
            "results/real_data-cpu.md", "results/workers_under_load-cpu.md", "results/cli-quickstart-cpu.md",
            "results/cli-nothing-fits-cpu.md", "results/cli-hf-factory-cpu.md"} <= included


def test_the_version_follows_the_schema_and_the_docs_list_every_schema_version():
    """autotune's minor version is the report's schema version (0.4 writes schema 4), and docs/report.md's Versions
    table has one row for each schema version, the current one included."""
    from autotune.report import SCHEMA_VERSION

    spec = importlib.util.spec_from_file_location("_version", ROOT / "autotune" / "_version.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    major, minor, _ = (int(part) for part in module.__version__.split("."))
    assert (major, minor) == (0, SCHEMA_VERSION), module.__version__
    text = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    section = text.split("\n## Versions\n", 1)[1].split("\n## ", 1)[0]
    rows = [int(m.group(1)) for m in re.finditer(r"^\| (\d+) \|", section, re.MULTILINE)]
    assert rows == list(range(1, SCHEMA_VERSION + 1))


def test_the_report_page_names_the_current_schema_and_the_migrated_reports():
    """docs/report.md's key list gives the schema autotune writes and the versions it also reads, and its list of
    migrated reports is the set of files of results/ with a ``migrated`` key."""
    import json

    from autotune.report import READABLE_VERSIONS, SCHEMA_VERSION

    text = (ROOT / "docs" / "report.md").read_text(encoding="utf-8")
    written, oldest, newest = re.search(r"`schema_version` \((\d+), .*? also read versions (\d+) to (\d+)", text,
                                        re.DOTALL).groups()
    assert (int(written), int(oldest), int(newest)) == (SCHEMA_VERSION, READABLE_VERSIONS[0], SCHEMA_VERSION - 1)
    paragraph = text[text.index("The reports in `results/` that 0.4 measured"):].split("\n\n", 1)[0]
    named = set(re.findall(r"`(results/[\w.-]+\.json)`", paragraph))
    migrated = {f"results/{path.name}" for path in (ROOT / "results").glob("*.json")
                if isinstance(data := json.loads(path.read_text(encoding="utf-8")), dict) and "migrated" in data}
    assert migrated and named == migrated


def test_the_usage_page_lists_every_exit_code():
    """Every exit code the CLI's docstring names (``autotune/__main__.py``: 0, 3, 2, 130, 143, 1) is in
    docs/usage.md's exit codes."""
    main = (ROOT / "autotune" / "__main__.py").read_text(encoding="utf-8")
    said = main.split('"""', 2)[1]
    codes = set(re.findall(r"\b(\d+) (?:with|when|for)\b", said[said.index("Exit codes:"):]))
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"`(\d+)` (?:with|when|for)\b", text[text.index("Exit codes:"):].split("\n\n", 1)[0]))
    assert {"0", "1", "2", "3", "130", "143"} <= codes
    assert codes <= listed, sorted(codes - listed)


# --- the checks themselves can fail --------------------------------------------------------------------------------


@pytest.mark.parametrize("heading, slug", [
    ("Probe, training plan and `autotune.apply`", "probe-training-plan-and-autotuneapply"),
    ("Distributed training: DDP and FSDP under torchrun", "distributed-training-ddp-and-fsdp-under-torchrun"),
    ("What is measured, and how", "what-is-measured-and-how"),
    ("`show`: a saved report again", "show-a-saved-report-again"),
    ("Parallel workers under load, measured", "parallel-workers-under-load-measured"),
    ("zoo gpt_neox: fp32, batch 32, 4 blocks", "zoo-gpt_neox-fp32-batch-32-4-blocks"),
    ("A - B", "a---b"),
    ("[Linked](x.md) heading", "linked-heading"),
])
def test_github_anchor_rules(heading, slug):
    assert github_slug(heading) == slug


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n\n## Same\n\n## Same\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[ok](../README.md#same-1) [self](#page) [web](https://example.org/x) [dir](../docs)\n"
        "[gone](missing.md) [bad anchor](../README.md#nowhere) [out](../../elsewhere.md)\n"
        "`[in code](missing-too.md)`\n"
        "```\n[in a fence](missing-as-well.md)\n```\n"
        "[ref]: nothing.md\n",
        encoding="utf-8")
    assert broken_links(page, tmp_path) == [
        "docs/page.md:4: missing.md: no such file",
        "docs/page.md:4: ../README.md#nowhere: README.md has no heading '#nowhere'",
        "docs/page.md:4: ../../elsewhere.md: leaves the repository",
        "docs/page.md:9: nothing.md: no such file",
    ]


def test_a_stale_include_block_is_named_then_synced(tmp_path):
    sync = _sync_docs()
    (tmp_path / "results").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "x.md").write_text("# X\n\n| a |\n|---|\n| 2 |\n", encoding="utf-8")
    page = tmp_path / "docs" / "p.md"
    example = "```\n<!-- include: results/x.md -->\nan example in a fence: not a block\n<!-- end include -->\n```\n"
    page.write_text(example + "# P\n\n## Figures\n\n<!-- include: results/x.md shift-headings=2 -->\n| a |\n|---|\n"
                    "| 1 |\n<!-- end include -->\n\nafter\n", encoding="utf-8")
    assert sync.check(tmp_path) == ["docs/p.md:10: the copy of results/x.md is stale"]
    assert sync.main(["--check", "--root", str(tmp_path)]) == 1
    assert sync.main(["--root", str(tmp_path)]) == 0
    assert page.read_text(encoding="utf-8") == example + (
        "# P\n\n## Figures\n\n<!-- include: results/x.md shift-headings=2 -->\n### X\n\n| a |\n|---|\n| 2 |\n"
        "<!-- end include -->\n\nafter\n")
    assert sync.check(tmp_path) == []
    assert sync.main(["--check", "--root", str(tmp_path)]) == 0


def test_a_script_is_included_in_a_code_fence(tmp_path):
    sync = _sync_docs()
    (tmp_path / "docs" / "examples").mkdir(parents=True)
    (tmp_path / "docs" / "examples" / "x.py").write_text("# a comment, not a heading\nprint(1)\n", encoding="utf-8")
    page = tmp_path / "docs" / "p.md"
    page.write_text("# P\n\n<!-- include: docs/examples/x.py fence=python shift-headings=1 -->\n<!-- end include -->\n",
                    encoding="utf-8")
    assert sync.main(["--root", str(tmp_path)]) == 0
    assert page.read_text(encoding="utf-8") == (
        "# P\n\n<!-- include: docs/examples/x.py fence=python shift-headings=1 -->\n```python\n# a comment, not a heading\n"
        "print(1)\n```\n<!-- end include -->\n")
    assert sync.check(tmp_path) == []


@pytest.mark.parametrize("block, error", [
    ("<!-- include: results/none.md -->\n<!-- end include -->\n", "results/none.md, which does not exist"),
    ("<!-- include: results/x.md -->\ntext\n", "without its '<!-- end include -->' line"),
    ("<!-- include: results/x.md levels=2 -->\n<!-- end include -->\n", "unknown option 'levels=2'"),
])
def test_an_include_block_that_cannot_be_synced_is_an_error(tmp_path, block, error):
    sync = _sync_docs()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.md").write_text("x\n", encoding="utf-8")
    (tmp_path / "README.md").write_text("# R\n\n" + block, encoding="utf-8")
    with pytest.raises(sync.IncludeError, match=re.escape(error)):
        sync.check(tmp_path)
    assert sync.main(["--check", "--root", str(tmp_path)]) == 2


def test_a_stale_figure_is_named_then_synced(tmp_path):
    sync = _sync_docs()
    (tmp_path / "results").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "x.json").write_text(
        '{"wall_s": 1441.8, "trials": [{"precision": "bf16", "batch_size": 8, "samples_per_s": 73.904},'
        ' {"precision": "bf16", "batch_size": 16, "samples_per_s": 87.93}], "peak_bytes": 615123456}', encoding="utf-8")
    (tmp_path / "results" / "y.md").write_text("exit 0 (the machine's load average 0.8 as it started)\n", "utf-8")
    page = tmp_path / "docs" / "p.md"
    example = "```\n<!-- figure: results/x.json wall_s -->9.9 in a fence: an example, not a figure\n```\n"
    page.write_text(example + (
        "took <!-- figure: results/x.json wall_s -->1,400.0 s (<!-- figure: results/x.json wall_s/60 -->24.5 min),\n"
        "<!-- figure: results/x.json trials[precision=bf16,batch_size=8].samples_per_s -->78.9 and "
        "<!-- figure: results/x.json trials[1].samples_per_s -->87.9 samples/s,\n"
        "<!-- figure: results/x.json peak_bytes/1048576 -->586.63 MiB at a load of "
        "<!-- figure: results/y.md /load average ([0-9.]+)/ -->5.4.\n"), encoding="utf-8")
    assert sync.check(tmp_path) == [
        "docs/p.md:4: the figure 1,400.0 is stale: results/x.json says 1,441.8 (wall_s)",
        "docs/p.md:4: the figure 24.5 is stale: results/x.json says 24.0 (wall_s/60)",
        "docs/p.md:5: the figure 78.9 is stale: results/x.json says 73.9 "
        "(trials[precision=bf16,batch_size=8].samples_per_s)",
        "docs/p.md:6: the figure 5.4 is stale: results/y.md says 0.8 (/load average ([0-9.]+)/)",
    ]
    assert sync.main(["--check", "--root", str(tmp_path)]) == 1
    assert sync.main(["--root", str(tmp_path)]) == 0
    assert page.read_text(encoding="utf-8") == example + (
        "took <!-- figure: results/x.json wall_s -->1,441.8 s (<!-- figure: results/x.json wall_s/60 -->24.0 min),\n"
        "<!-- figure: results/x.json trials[precision=bf16,batch_size=8].samples_per_s -->73.9 and "
        "<!-- figure: results/x.json trials[1].samples_per_s -->87.9 samples/s,\n"
        "<!-- figure: results/x.json peak_bytes/1048576 -->586.63 MiB at a load of "
        "<!-- figure: results/y.md /load average ([0-9.]+)/ -->0.8.\n")
    assert sync.check(tmp_path) == []


@pytest.mark.parametrize("figure, error", [
    ("<!-- figure: results/x.json wall_s --> s", "a figure comment without a number right after it"),
    ("<!-- figure: results/none.json wall_s -->1.0", "quotes results/none.json, which does not exist"),
    ("<!-- figure: results/x.json wall -->1.0", "x.json: wall: no 'wall' there (KeyError)"),
    ("<!-- figure: results/x.json trials[precision=bf16].samples_per_s -->1.0", "2 items have precision=bf16"),
    ("<!-- figure: results/x.json trials[0].precision -->1.0", "trials[0].precision is 'bf16', not a number"),
    ("<!-- figure: results/x.json /load ([0-9]+)/ -->1.0", "nothing matches /load ([0-9]+)/"),
])
def test_a_figure_that_cannot_be_read_is_an_error(tmp_path, figure, error):
    sync = _sync_docs()
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.json").write_text(
        '{"wall_s": 1.0, "trials": [{"precision": "bf16"}, {"precision": "bf16"}]}', encoding="utf-8")
    (tmp_path / "README.md").write_text(f"# R\n\nfigure: {figure}\n", encoding="utf-8")
    with pytest.raises(sync.IncludeError, match=re.escape(error)):
        sync.check(tmp_path)
    assert sync.main(["--check", "--root", str(tmp_path)]) == 2

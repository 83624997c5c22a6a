"""Keep the docs' copies of committed result files equal to the files (stdlib only).

A page copies a file between two comment lines, the path relative to the repository root:

    <!-- include: results/claims-cpu.md -->
    ...the file's text, written by this script...
    <!-- end include -->

``shift-headings=N`` after the path (``<!-- include: results/claims-cpu.md shift-headings=2 -->``) adds N
levels to the file's Markdown headings, so its ``#`` title sits under the page's own headings.
``fence=LANG`` (``<!-- include: docs/examples/x.py fence=python -->``) shows the file as a fenced code
block: a script the tests run, on the page as it is.

    python benchmarks/sync_docs.py           # rewrite every block of README.md and docs/**/*.md from its file
    python benchmarks/sync_docs.py --check   # change nothing; exit 1 naming each stale block

A figure quoted in prose names the file and the key it comes from, in a comment just before it:

    the search took <!-- figure: results/search_efficiency-cpu.json wall_s -->1,441.8 s

The key is a JSON path (``models[0].wall_s``; ``trials[precision=bf16,batch_size=8].samples_per_s`` picks the one
list item whose fields read so), optionally scaled (``peak_bytes/1048576`` for MiB, ``vs_search*100`` for a
percentage); for a file that is not JSON it is a regular expression between slashes whose first group is the figure
(``/load average ([0-9.]+)/``: its first match). The figure keeps the decimals and the thousands separators the page
gives it; the script rewrites it from the file, and ``--check`` names each figure that differs.

Run it after regenerating a result file; ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent

_BLOCK = re.compile(
    r"^<!-- include: (?P<path>\S+)(?P<options>(?: +[a-z-]+=\S+)*) *-->\n"
    r"(?P<body>.*?)"
    r"^<!-- end include -->$",
    re.MULTILINE | re.DOTALL,
)
_OPEN = re.compile(r"^<!-- include:", re.MULTILINE)
_HEADING = re.compile(r"^(#{1,6})(?= )")
_FENCE = re.compile(r"^(```|~~~)")
_FIGURE = re.compile(r"<!-- figure: (?P<path>\S+) (?P<key>.+?) -->"
                     r"(?P<number>-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|-?\d+(?:\.\d+)?)?")
_FIGURE_OPEN = re.compile(r"<!-- figure:")
_STEP = re.compile(r"\.?(?P<name>[^.\[\]]+)|\[(?P<index>-?\d+)\]|\[(?P<select>[^\]=]+=[^\]]*)\]")
_SCALE = re.compile(r"(?P<key>.*?)(?P<op>[*/])(?P<by>\d+(?:\.\d+)?)$")


class Block(NamedTuple):
    page: Path  # the Markdown page holding the block
    line: int  # the line of its opening comment
    source: str  # the included file, relative to the root
    start: int  # the body's offsets in the page's text
    end: int
    body: str
    shift: int
    fence: str = ""  # the language of the code fence the file is shown in ("" : the file is Markdown)


class Figure(NamedTuple):
    page: Path  # the Markdown page quoting it
    line: int
    source: str  # the file it comes from, relative to the root
    key: str  # its JSON path (or /regex/) in that file
    start: int  # the figure's offsets in the page's text
    end: int
    text: str  # the figure as the page gives it ("1,441.8")


class IncludeError(ValueError):
    """An include block that cannot be synced: an unclosed block, an unknown option, a file that is missing."""


def pages(root: Path = ROOT) -> List[Path]:
    """The pages that may hold include blocks: README.md and every Markdown file under docs/."""
    found = [root / "README.md"] if (root / "README.md").is_file() else []
    return found + sorted((root / "docs").rglob("*.md"))


def _fenced(text: str) -> List[range]:
    """The offsets of the page's fenced code blocks, where an include line is an example, not a block."""
    spans, start, at = [], None, 0
    for line in text.split("\n"):
        if _FENCE.match(line.lstrip(" ")):
            if start is None:
                start = at
            else:
                spans.append(range(start, at + len(line)))
                start = None
        at += len(line) + 1
    return spans + ([range(start, len(text))] if start is not None else [])


def blocks(page: Path) -> Iterator[Block]:
    text = page.read_text(encoding="utf-8")
    fenced = _fenced(text)
    matches = [m for m in _BLOCK.finditer(text) if not any(m.start() in span for span in fenced)]
    opened = [m.start() for m in _OPEN.finditer(text) if not any(m.start() in span for span in fenced)]
    if len(opened) != len(matches):
        closed = {m.start() for m in matches}
        line = next(text.count("\n", 0, at) + 1 for at in opened if at not in closed)
        raise IncludeError(f"{page}:{line}: an include block without its '<!-- end include -->' line")
    for m in matches:
        shift, fence = 0, ""
        for option in m.group("options").split():
            key, _, value = option.partition("=")
            if key == "shift-headings" and value.isdigit():
                shift = int(value)
            elif key == "fence" and value.isalnum():
                fence = value
            else:
                raise IncludeError(f"{page}:{text.count(chr(10), 0, m.start()) + 1}: unknown option {option!r}")
        yield Block(page, text.count("\n", 0, m.start()) + 1, m.group("path"), m.start("body"), m.end("body"),
                    m.group("body"), shift, fence)


def figures(page: Path) -> Iterator[Figure]:
    """The figures ``page`` quotes from files (outside code fences), each after its ``<!-- figure: ... -->``."""
    text = page.read_text(encoding="utf-8")
    fenced = _fenced(text)
    for m in _FIGURE_OPEN.finditer(text):
        if any(m.start() in span for span in fenced):
            continue
        line = text.count("\n", 0, m.start()) + 1
        figure = _FIGURE.match(text, m.start())
        if figure is None or figure.group("number") is None:
            raise IncludeError(f"{page}:{line}: a figure comment without a number right after it")
        yield Figure(page, line, figure.group("path"), figure.group("key"), figure.start("number"),
                     figure.end("number"), figure.group("number"))


def figure_value(source: Path, key: str) -> float:
    """The number ``key`` names in ``source``: a JSON path, scaled where it ends in ``/N`` or ``*N``, or the first
    group of the regular expression ``/.../`` in a file of text."""
    text = source.read_text(encoding="utf-8")
    if len(key) > 1 and key.startswith("/") and key.endswith("/"):
        found = re.search(key[1:-1], text)
        if found is None or not found.groups():
            raise IncludeError(f"{source.name}: nothing matches {key}, or it has no group")
        return _number(found.group(1), key, source)
    scale = _SCALE.match(key)
    path, op, by = (scale.group("key"), scale.group("op"), float(scale.group("by"))) if scale else (key, "*", 1.0)
    value = _at(json.loads(text), path, source)
    number = _number(value, key, source)
    return number * by if op == "*" else number / by


def _at(value: Any, path: str, source: Path) -> Any:
    """The value at ``path`` (``a.b[2].c``, ``items[k=v,k2=v2].field``) of a loaded JSON document."""
    at = 0
    for step in _STEP.finditer(path):
        if step.start() != at:
            break
        at = step.end()
        try:
            if step.group("name") is not None:
                value = value[step.group("name")]
            elif step.group("index") is not None:
                value = value[int(step.group("index"))]
            else:
                wanted = dict(pair.partition("=")[::2] for pair in step.group("select").split(","))
                chosen = [item for item in value if all(str(item.get(k)) == v for k, v in wanted.items())]
                if len(chosen) != 1:
                    raise IncludeError(f"{source.name}: {path}: {len(chosen)} items have {step.group('select')}")
                value = chosen[0]
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise IncludeError(f"{source.name}: {path}: no {step.group(0)!r} there ({type(exc).__name__})") from None
    if at != len(path):
        raise IncludeError(f"{source.name}: {path}: cannot read the path from {path[at:]!r}")
    return value


def _number(value: Any, key: str, source: Path) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value.replace(",", "") if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise IncludeError(f"{source.name}: {key} is {value!r}, not a number") from None


def formatted(value: float, like: str) -> str:
    """``value`` written as the page writes ``like``: as many decimals, thousands separated where it separates them."""
    decimals = len(like.partition(".")[2])
    return f"{value:{',' if ',' in like else ''}.{decimals}f}"


def _expected_figure(figure: Figure, root: Path) -> str:
    source = root / figure.source
    if not source.is_file():
        raise IncludeError(f"{_name(figure, root)}: quotes {figure.source}, which does not exist")
    try:
        return formatted(figure_value(source, figure.key), figure.text)
    except IncludeError as exc:
        raise IncludeError(f"{_name(figure, root)}: {exc}") from None


def rendered(source: Path, shift: int = 0, fence: str = "") -> str:
    """The text a block of ``source`` holds: the file as it is, its headings moved down ``shift`` levels (or the
    file in a code fence of language ``fence``)."""
    lines = source.read_text(encoding="utf-8").rstrip("\n").split("\n")
    if fence:
        return "\n".join([f"```{fence}", *lines, "```"]) + "\n"
    fenced = False
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and shift:
            heading = _HEADING.match(line)
            if heading:
                lines[i] = "#" * min(6, len(heading.group(1)) + shift) + line[heading.end():]
    return "\n".join(lines) + "\n"


def _expected(block: Block, root: Path) -> str:
    source = root / block.source
    if not source.is_file():
        raise IncludeError(f"{_name(block, root)}: includes {block.source}, which does not exist")
    return rendered(source, block.shift, block.fence)


def _name(block: Block | Figure, root: Path) -> str:
    try:
        page = block.page.relative_to(root)
    except ValueError:
        page = block.page
    return f"{page}:{block.line}"


def check(root: Path = ROOT, files: Optional[Sequence[Path]] = None) -> List[str]:
    """One line per stale block ('docs/x.md:12: the copy of results/y.md is stale') or figure; empty when every block
    and figure matches its file.

    Raises :class:`IncludeError` for a block that cannot be synced at all."""
    stale = []
    for page in files if files is not None else pages(root):
        for block in blocks(page):
            if block.body != _expected(block, root):
                stale.append(f"{_name(block, root)}: the copy of {block.source} is stale")
        stale += [_stale_figure(figure, expected, root) for figure, expected in _figures_to_change(page, root)]
    return stale


def _figures_to_change(page: Path, root: Path) -> List[tuple]:
    """(figure, what the file says) for each figure of ``page`` that differs from its file."""
    found = [(figure, _expected_figure(figure, root)) for figure in figures(page)]
    return [(figure, expected) for figure, expected in found if figure.text != expected]


def _stale_figure(figure: Figure, expected: str, root: Path) -> str:
    return f"{_name(figure, root)}: the figure {figure.text} is stale: {figure.source} says {expected} ({figure.key})"


def sync(root: Path = ROOT, files: Optional[Sequence[Path]] = None) -> List[str]:
    """Rewrite every stale block and figure from its file; returns the lines :func:`check` would have given."""
    changed = []
    for page in files if files is not None else pages(root):
        text = page.read_text(encoding="utf-8")
        pieces, at = [], 0
        for block in blocks(page):
            expected = _expected(block, root)
            if block.body != expected:
                changed.append(f"{_name(block, root)}: the copy of {block.source} is stale")
            pieces += [text[at:block.start], expected]
            at = block.end
        new = "".join(pieces) + text[at:]
        if new != text:
            page.write_text(new, encoding="utf-8")
        changed += _sync_figures(page, root)
    return changed


def _sync_figures(page: Path, root: Path) -> List[str]:
    """Rewrite each figure of ``page`` that differs from its file; the lines :func:`check` would have given."""
    text = page.read_text(encoding="utf-8")
    stale = _figures_to_change(page, root)
    for figure, expected in reversed(stale):  # from the end: the earlier offsets stay right
        text = text[:figure.start] + expected + text[figure.end:]
    if stale:
        page.write_text(text, encoding="utf-8")
    return [_stale_figure(figure, expected, root) for figure, expected in stale]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: %(default)s)")
    parser.add_argument("pages", nargs="*", type=Path, help="pages to look at (default: README.md and docs/**/*.md)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = [p.resolve() for p in args.pages] or None
    try:
        lines = check(root, files) if args.check else sync(root, files)
    except IncludeError as exc:
        print(f"sync_docs: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line if args.check else line.replace("is stale", "was stale: rewritten"))
    if args.check and lines:
        print(f"sync_docs: {len(lines)} stale block(s) or figure(s); run python benchmarks/sync_docs.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

Run it after regenerating a result file; ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Sequence

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


class Block(NamedTuple):
    page: Path  # the Markdown page holding the block
    line: int  # the line of its opening comment
    source: str  # the included file, relative to the root
    start: int  # the body's offsets in the page's text
    end: int
    body: str
    shift: int
    fence: str = ""  # the language of the code fence the file is shown in ("" : the file is Markdown)


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


def _name(block: Block, root: Path) -> str:
    try:
        page = block.page.relative_to(root)
    except ValueError:
        page = block.page
    return f"{page}:{block.line}"


def check(root: Path = ROOT, files: Optional[Sequence[Path]] = None) -> List[str]:
    """One line per stale block ('docs/x.md:12: results/y.md is stale'); empty when every block matches its file.

    Raises :class:`IncludeError` for a block that cannot be synced at all."""
    stale = []
    for page in files if files is not None else pages(root):
        for block in blocks(page):
            if block.body != _expected(block, root):
                stale.append(f"{_name(block, root)}: the copy of {block.source} is stale")
    return stale


def sync(root: Path = ROOT, files: Optional[Sequence[Path]] = None) -> List[str]:
    """Rewrite every stale block from its file; returns the lines :func:`check` would have given."""
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
    return changed


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
        print(f"sync_docs: {len(lines)} stale block(s); run python benchmarks/sync_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

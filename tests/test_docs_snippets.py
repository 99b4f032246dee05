"""Every python and bash block in README.md and docs/**/*.md runs, at a small size, on the CPU.

The blocks of one page continue each other, as a reader runs them: they share one namespace and one
temporary working folder (with ``examples/`` linked in), in page order. A block that cannot run here
says so in the markdown, on the line just before it::

    <!-- not-run: needs a CUDA GPU -->

and is reported as skipped with that reason. ``<!-- slow: why -->`` runs the block under the
``slow`` marker. Every fence names its language, so no block escapes by having none. Under
pytest-xdist a page's blocks run on one worker (its ``xdist_group``), so each runs once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = {"python", "bash"}
SHOWN = {"text", "toml", "json", "yaml"}  # shown, never run

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                    re.M | re.S)
_MARK = re.compile(r"<!--\s*(?P<kind>not-run|slow):\s*(?P<reason>.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mark: str | None = None  # "not-run" or "slow"
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the marker on the line before each (if any)."""
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        mark = _MARK.fullmatch(before.strip())
        body = "\n".join(row[len(m["indent"]):] for row in m["body"].splitlines())
        found.append(Block(page, line, m["lang"], body, mark and mark["kind"], mark["reason"] if mark else ""))
    return found


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.lang in RUN]


def test_every_block_names_a_language_this_test_knows():
    unknown = [f"{b.name} ({b.lang or 'no language'})" for b in ALL if b.lang not in RUN | SHOWN]
    assert not unknown, f"name the fence's language ({sorted(RUN | SHOWN)}): {unknown}"


def test_every_marker_is_attached_to_a_runnable_block():
    marked = {(b.page, b.line) for b in ALL if b.mark}
    for page in PAGES:
        text = page.read_text()
        for m in _MARK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            following = [b for b in blocks(page) if b.line > line]
            assert following and (page, following[0].line) in marked, (
                f"{page.relative_to(ROOT)}:{line}: a marker must sit on the line just before a fence")
            assert following[0].lang in RUN, f"{page.relative_to(ROOT)}:{line}: marks a block that is not run"
            assert m["reason"], f"{page.relative_to(ROOT)}:{line}: say why"


class _Page:
    """What a page's blocks share: a namespace, a folder, and how far they have run."""

    def __init__(self, folder: Path):
        self.namespace: dict = {"__name__": "__docs__"}
        self.folder = folder
        self.done: set[int] = set()
        self.failed: str | None = None


_PAGES: dict[Path, _Page] = {}


def _page(block: Block, tmp_path_factory) -> _Page:
    if block.page not in _PAGES:
        folder = tmp_path_factory.mktemp(block.page.stem)
        (folder / "examples").symlink_to(ROOT / "examples")
        _PAGES[block.page] = _Page(folder)
    return _PAGES[block.page]


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="100", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run(block: Block, page: _Page, monkeypatch) -> None:
    if block.lang == "python":
        monkeypatch.chdir(page.folder)
        exec(compile(block.code, block.name, "exec"), page.namespace)
        return
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=page.folder, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _params():
    for b in RUNNABLE:
        # a page's blocks on one xdist worker: each runs the blocks before it once per process
        marks = [pytest.mark.xdist_group(f"docs:{b.page.relative_to(ROOT)}")]
        marks += [pytest.mark.slow] if b.mark == "slow" else []
        yield pytest.param(b, id=b.name, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_the_block_runs(block: Block, tmp_path_factory, monkeypatch):
    if block.mark == "not-run":
        pytest.skip(f"{block.name}: not run: {block.reason}")
    page = _page(block, tmp_path_factory)
    # The blocks before this one on its page first (they define what it uses), once each.
    for earlier in (b for b in RUNNABLE if b.page == block.page and b.line <= block.line):
        if earlier.mark == "not-run" or earlier.line in page.done:
            continue
        if page.failed:
            pytest.fail(f"an earlier block of the page failed: {page.failed}")
        try:
            _run(earlier, page, monkeypatch)
        except BaseException:
            page.failed = earlier.name
            raise
        page.done.add(earlier.line)

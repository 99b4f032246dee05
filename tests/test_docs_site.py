"""The documentation site covers the code: every public name has an entry in the API reference
(``docs/api/*.md``) that griffe, mkdocstrings' loader, resolves; the README stays a short front door
whose first two commands are the ones CI runs. (``mkdocs build --strict`` itself runs in ``.ci/run``.)"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import mixprec

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
#: The sub-modules users import from: each has a section in the API reference, and each name in its
#: ``__all__`` an entry (or is the same object as a name documented elsewhere).
SUBMODULES = [
    "mixprec.accelerator", "mixprec.accelerator.handlers", "mixprec.checkpoint", "mixprec.diagnostics",
    "mixprec.diagnostics.hf", "mixprec.distributed", "mixprec.integrations.engine_checkpoints", "mixprec.lightning", "mixprec.precision", "mixprec.precision.bf16_true",
    "mixprec.precision.fp8", "mixprec.precision.optim", "mixprec.tasks", "mixprec.tracking", "mixprec.trainer",
]
FIRST_COMMANDS = ('python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e ".[plot]" && .venv/bin/mixprec demo\n'
                  '.venv/bin/pip install -e ".[dev]" && .venv/bin/python -m pytest')


def directives() -> list[str]:
    """The objects the API pages render (``::: dotted.path`` lines)."""
    return [m[1] for page in sorted(API.glob("*.md")) for m in re.finditer(r"^::: (\S+)", page.read_text(), re.M)]


def _object(path: str) -> object:
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:  # a name in a module
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def test_every_public_name_of_mixprec_has_an_entry_in_the_api_reference():
    rendered = set(directives())
    missing = [n for n in mixprec.__all__ if n != "__version__" and f"mixprec.{n}" not in rendered]
    assert not missing, f"add `::: mixprec.NAME` to a page of docs/api/ for: {missing}"


@pytest.mark.parametrize("module", SUBMODULES)
def test_every_public_name_of_the_submodules_is_documented_once_somewhere(module):
    rendered = directives()
    assert module in rendered, f"docs/api/ has no `::: {module}` section"
    documented = {id(_object(path)) for path in rendered}
    mod = importlib.import_module(module)
    missing = [n for n in mod.__all__ if f"{module}.{n}" not in rendered and id(getattr(mod, n)) not in documented]
    assert not missing, f"add `::: {module}.NAME` to a page of docs/api/ for: {missing}"


def test_griffe_resolves_every_entry_of_the_api_reference():
    griffe = pytest.importorskip("griffe", reason="the docs extra (mkdocstrings[python]) is not installed")
    package = griffe.load("mixprec", search_paths=[str(ROOT / "src")], resolve_aliases=False)
    unresolved = []
    for path in directives():
        try:
            obj = package if path == "mixprec" else package[path.removeprefix("mixprec.")]
            obj.kind  # noqa: B018 (resolves an alias: an import griffe cannot follow raises here)
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            unresolved.append(path)
    assert not unresolved, f"griffe cannot resolve: {unresolved}"


def test_the_readme_is_a_short_front_door_whose_first_commands_are_cis():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "the README is the front door: move the detail into docs/"
    first = re.search(r"```bash\n(.*?)\n```", text, re.S)
    assert first and first[1] == FIRST_COMMANDS, "the README's first two commands changed"
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    demo, tests = FIRST_COMMANDS.splitlines()
    assert demo in ci, "CI runs the README's first command as written"
    assert ci[-1] == tests, "CI runs the README's second command last, as written"


def test_the_readmes_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)#][^)]*)\)", text) if "://" not in t]
    broken = [t for t in targets if not (ROOT / t).exists()]
    assert not broken, f"README.md links to missing files: {broken}"

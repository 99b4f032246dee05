"""The reference packages (``conftest.REFERENCES``), which the differential tests take their expected
values from: the test extras install every one, and where ``MIXPREC_REQUIRE_REFERENCES`` is set (CI)
a missing one fails the run, naming it and the fix, instead of skipping the tests that need it;
elsewhere those tests still skip."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIX, REFERENCES, REQUIRE

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, a core dependency there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _dev_extra() -> set[str]:
    """The distributions ``pip install -e ".[dev]"`` asks for, with mixprec's own extras it names expanded."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names, todo = set(), ["dev"]
    while todo:
        for requirement in extras[todo.pop()]:
            name, wanted = re.match(r"([\w.-]+)(?:\[([\w,-]+)\])?", requirement).groups()
            if name == "mixprec":
                todo += wanted.split(",")
            else:
                names.add(name.lower().replace("_", "-"))
    return names


def test_the_dev_extra_installs_every_reference_package_and_ci_requires_them():
    wanted = {name.replace("_", "-") for name in REFERENCES}  # import names to distribution names
    assert wanted <= _dev_extra(), wanted - _dev_extra()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    tests = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert f"export {REQUIRE}=1" in lines[:tests]


def _pytest(folder: Path, hide: str, required: bool) -> subprocess.CompletedProcess:
    """pytest run on ``folder`` (this conftest, the toys it imports, and a test) in a fresh interpreter where ``hide``
    cannot be imported (``importlib.util.find_spec`` says it is not there)."""
    run = f"import sys; sys.modules[{hide!r}] = None; import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider']))"
    env = {k: v for k, v in os.environ.items() if k != REQUIRE} | ({REQUIRE: "1"} if required else {})
    return subprocess.run([sys.executable, "-c", run], cwd=folder, capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for shared in ("conftest.py", "toys.py"):  # the conftest imports toys
        shutil.copy(Path(__file__).with_name(shared), tmp_path / shared)
    (tmp_path / "test_needs.py").write_text(
        "import pytest\n\n\n"
        "def test_needs_schedulefree():\n    pytest.importorskip('schedulefree')\n\n\n"
        "def test_needs_torchaos_float8():\n    pytest.importorskip('torchao.float8')\n\n\n"
        "def test_needs_nothing():\n    pass\n")
    return tmp_path


def test_without_the_variable_a_missing_reference_skips_its_tests(folder):
    run = _pytest(folder, "schedulefree", required=False)
    assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout + run.stderr


def test_in_ci_a_missing_reference_package_stops_the_run_naming_it_and_the_fix(folder):
    run = _pytest(folder, "schedulefree", required=True)
    assert run.returncode != 0 and "passed" not in run.stdout, run.stdout
    assert f"{REQUIRE} is set, and these reference packages are not installed: schedulefree" in run.stderr, run.stderr
    assert 'pip install -e ".[dev]"' in run.stderr and FIX in run.stderr


def test_in_ci_a_missing_part_of_an_installed_reference_fails_the_tests_that_skip_for_it(folder):
    run = _pytest(folder, "torchao.float8", required=True)
    assert run.returncode == 1 and "1 failed, 2 passed" in run.stdout, run.stdout
    assert "reference module torchao.float8 is missing" in run.stdout and FIX in run.stdout

"""``import mixprec`` prints nothing and loads nothing beyond the standard library and its core
dependencies: torchao, transformers, accelerate, datasets, scikit-learn, the trackers and every
other optional dependency are imported when they are used, not on import (issue 35: torchao's
failed kernel loads and torch's Enum warnings on every import, in every script)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

#: Modules no distribution installs: the interpreter's build configuration (read by sysconfig) and the
#: runtime modules any Cython extension registers (the extension's own package is judged by its name).
RUNTIME = ("_sysconfigdata_", "_cython_", "cython_runtime", "_cyutility")
STATEMENTS = ["import mixprec",
              "from mixprec import Accelerator, LossScaler, Trainer, TrainingArguments, resolve_precision"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _core_distributions() -> set[str]:
    """mixprec's dependencies outside any extra (torch, numpy, safetensors, tqdm, ...), and theirs, down
    to the leaves, as installed here."""
    seen: set[str] = set()
    todo = ["mixprec"]
    while todo:
        name = todo.pop()
        if _canonical(name) in seen:
            continue
        seen.add(_canonical(name))
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # a marker's dependency not installed here (tomli on Python 3.11+)
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _allowed(module: str, core: set[str], owners: dict[str, list[str]]) -> bool:
    return (module in sys.stdlib_module_names or module == "mixprec" or module.startswith(RUNTIME)
            or any(_canonical(d) in core for d in owners.get(module, [])))


@pytest.mark.parametrize("statement", STATEMENTS)
def test_importing_mixprec_prints_nothing(statement, tmp_path):
    quiet = subprocess.run([sys.executable, "-c", statement], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and quiet.stderr == "", (quiet.stdout, quiet.stderr)


@pytest.mark.parametrize("statement", STATEMENTS)
def test_importing_mixprec_loads_only_the_standard_library_and_its_core_dependencies(statement, tmp_path):
    """The top-level modules ``import mixprec`` adds to those ``import torch`` loads are each of the
    standard library, mixprec's or a distribution its core dependencies require (torch's own lazy
    imports, such as sympy, among them); accelerate, datasets, scikit-learn or any other is a failure."""
    probe = ("import json, sys\nimport torch\nbefore = {m.split('.')[0] for m in sys.modules}\n"
             f"{statement}\n"
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} - before)))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    added = json.loads(loaded.stdout)
    assert "mixprec" in added
    core, owners = _core_distributions(), importlib.metadata.packages_distributions()
    assert {"torch", "numpy", "safetensors", "tqdm"} <= core and not core & {"accelerate", "datasets", "scikit-learn"}
    outside = [m for m in added if not _allowed(m, core, owners)]
    assert outside == [], f"import mixprec loads {outside}: import them where they are used"

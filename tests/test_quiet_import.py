"""``import mixprec`` prints nothing: torchao, the trackers and the other optional dependencies
are imported when they are used, not on import (issue 35: torchao's failed kernel loads and
torch's Enum warnings on every import, in every script)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("statement", [
    "import mixprec",
    "from mixprec import Accelerator, LossScaler, Trainer, TrainingArguments, resolve_precision",
])
def test_importing_mixprec_prints_nothing_and_loads_no_optional_dependency(statement, tmp_path):
    probe = (f"{statement}\nimport sys\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torchao', 'transformers', 'wandb', 'mlflow', 'tensorboard', 'matplotlib', 'aim', 'dvclive', 'trackio')),"
             " file=sys.stderr)")
    quiet = subprocess.run([sys.executable, "-c", statement], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and quiet.stderr == "", (quiet.stdout, quiet.stderr)
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert loaded.stderr.strip() == "[]", loaded.stderr

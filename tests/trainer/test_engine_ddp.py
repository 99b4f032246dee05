"""transformers' own Trainer under torchrun with 2 gloo processes trains with DDP through mixprec's
Accelerator (``mixprec.patch_transformers()``) as it does through Accelerate: the same logs (losses,
gradient norms, the evaluation loss gathered over both processes) and the same weights on both ranks
(``tests/scripts/engine_ddp.py``)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from toys import SCRIPTS, torchrun

pytestmark = pytest.mark.slow  # two torchrun launches of 2 gloo processes
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _run(lib, out):
    proc = subprocess.run(torchrun(SCRIPTS / "engine_ddp.py", lib, str(out)), capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def _numbers(logs):
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss", "epoch")
    return [{k: row[k] for k in keys if k in row} for row in logs if any(k in row for k in keys[:4])]


def test_transformers_trainer_trains_with_ddp_through_mixprec_as_through_accelerate(tmp_path):
    theirs = _run("accelerate", tmp_path / "accelerate")
    ours = _run("mixprec", tmp_path / "mixprec")
    assert [r["accelerator"] for r in ours] == ["mixprec.accelerator.accelerator"] * 2
    assert all(r["ddp"] for r in theirs + ours)
    for t, o in zip(theirs, ours):
        assert _numbers(o["logs"]) == _numbers(t["logs"])
        assert o["weights"] == t["weights"]
    assert ours[0]["weights"] == ours[1]["weights"]

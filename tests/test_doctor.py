"""``mixprec doctor``: probes three precisions, writes a report, three readable plots, a recommendation."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec.apps.doctor import DoctorConfig, run_doctor
from mixprec.cli import main

from toys import blobs

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")
PNG = b"\x89PNG\r\n\x1a\n"


def test_doctor_on_a_built_in_task_writes_report_plots_and_a_recommendation(tmp_path, capsys):
    out = tmp_path / "doc"
    rc = main(["doctor", "--task", "pycode", "--size", "tiny", "--task.max_bytes", "60000", "--steps", "4",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recommendation:" in text and "initial loss scale for fp16" in text
    report = json.loads((out / "report.json").read_text())
    assert report["recommendation"]["precision"] in {"fp32", "fp16-mixed", "bf16-mixed"}
    assert report["recommendation"]["reasons"] and report["recommendation"]["fp16_init_scale"] >= 1
    assert set(report["probes"]) == {"fp32", "fp16-mixed", "bf16-mixed"}
    assert any(row["module"].startswith("h.0") for row in report["layers"])
    for name in ("gradient_histogram.png", "loss_scale.png", "layer_underflow.png"):
        assert (out / name).read_bytes()[:8] == PNG
    md = (out / "report.md").read_text()
    assert "## Recommendation" in md and "| module |" in md


class Tiny(torch.nn.Module):
    """Gradients far below fp16's range: the loss is multiplied by 1e-7."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, features, labels):
        return {"loss": torch.nn.functional.cross_entropy(self.head(torch.tanh(self.body(features))).float(), labels) * 1e-7}


def test_doctor_sees_the_underflow_of_a_tiny_loss_and_what_scaling_saves(tmp_path):
    report = run_doctor(Tiny, blobs(64), tmp_path, config=DoctorConfig(steps=3, batch_size=16, cpu=True))
    layers = {r["module"]: r for r in report["layers"]}
    assert layers["body"]["fp16_flush"] > 0.5  # most gradient values would flush to zero unscaled
    assert layers["body"]["fp16_flush_at_scale"] < layers["body"]["fp16_flush"]
    assert any("flush" in r or "underflow" in r for r in report["recommendation"]["reasons"])


def test_doctor_without_a_task_says_how_to_name_one(capsys):
    assert main(["doctor"]) == 2
    assert "say which task" in capsys.readouterr().err


class NoLoss(torch.nn.Module):
    """Returns logits only: nothing for the doctor to train on."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 4)

    def forward(self, features, labels):
        return self.head(features)


def test_a_model_without_a_loss_is_a_value_error_that_says_what_to_return(tmp_path):
    with pytest.raises(ValueError, match="without a loss; its forward must return"):
        run_doctor(NoLoss, blobs(16), tmp_path, config=DoctorConfig(steps=1, batch_size=8, cpu=True))


def test_the_cli_says_a_model_without_a_loss_on_stderr_and_exits_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "noloss_task.py").write_text(
        "import torch\n"
        "from toys import blobs\n"
        "class NoLoss(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.head = torch.nn.Linear(16, 4)\n"
        "    def forward(self, features, labels):\n"
        "        return self.head(features)\n"
        "def model():\n    return NoLoss()\n"
        "def data():\n    return blobs(16)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["doctor", "--model", "noloss_task:model", "--data", "noloss_task:data", "--steps", "1", "--cpu",
               "--out", str(tmp_path / "doc")])
    captured = capsys.readouterr()
    assert rc == 2
    assert "mixprec doctor: error: the model returned Tensor without a loss" in captured.err
    assert "error" not in captured.out


def test_the_doctor_says_which_probe_runs_its_step_and_the_time_left(tmp_path):
    import io

    from mixprec.apps.progress import Progress

    log = io.StringIO()
    progress = Progress("doctor", stream=log, delay=0, log_interval=600)
    run_doctor(Tiny, blobs(64), tmp_path, config=DoctorConfig(steps=2, batch_size=16, cpu=True), progress=progress)
    progress.close("probed")
    lines = log.getvalue().splitlines()
    assert [line.split(";")[0] for line in lines[:-1]] == [
        "doctor: probe 1/3: fp32, building the model", "doctor: probe 2/3: fp16-mixed, building the model",
        "doctor: probe 3/3: bf16-mixed, building the model", "doctor: report: the plots, report.md and report.json"]
    assert "left" in lines[1] and lines[-1].startswith("doctor: probed in ")

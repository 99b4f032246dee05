"""``report_to`` names the trackers of mixprec.tracking, as transformers names its integrations:
a Trainer run logs to them for real (offline, on disk)."""

from __future__ import annotations

import pytest
import torch

import mixprec

pytest.importorskip("mlflow")
pytest.importorskip("dvclive")


class _Line(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x, labels=None):
        out = self.a * x
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


@pytest.mark.slow
def test_a_run_logs_its_losses_to_mlflow_and_dvclive(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "DVC_STUDIO_TOKEN", "DVCLIVE_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DVC_STUDIO_OFFLINE", "true")
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.chdir(tmp_path)
    x = torch.linspace(-1, 1, 16)
    data = [{"x": x[i:i + 1].squeeze(0), "labels": 3 * x[i:i + 1].squeeze(0)} for i in range(16)]
    args = mixprec.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                                     logging_steps=1, report_to=["mlflow", "dvclive"], save_strategy="no",
                                     disable_tqdm=True, use_cpu=True, run_name="line")
    trainer = mixprec.Trainer(model=_Line(), args=args, train_dataset=data)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    import mlflow

    run = mlflow.search_runs(search_all_experiments=True, output_format="list")[0]
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4] and [round(m.value, 4) for m in history] == [
        round(v, 4) for v in losses]
    assert run.data.params["learning_rate"] == str(args.learning_rate)  # the arguments as the run's config
    dvc_losses = (tmp_path / "dvclive" / "plots" / "metrics" / "loss.tsv").read_text().split("\n")[1:]
    assert len([line for line in dvc_losses if line]) == 4


@pytest.mark.slow
def test_a_run_logs_its_losses_and_arguments_to_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import json

    from test_tracking import _wandb_records, wandb_offline

    wandb_offline(monkeypatch, tmp_path)
    import wandb

    wandb.teardown()  # an earlier run in this process left wandb's settings (its folder) behind
    x = torch.linspace(-1, 1, 16)
    data = [{"x": x[i], "labels": 3 * x[i]} for i in range(16)]
    args = mixprec.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                                     logging_steps=1, report_to="wandb", save_strategy="no", disable_tqdm=True,
                                     use_cpu=True, learning_rate=0.25)
    trainer = mixprec.Trainer(model=_Line(), args=args, train_dataset=data)
    trainer.train()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    config = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["learning_rate"] == 0.25 and config["train_batch_size"] == 4
    history = [{i.nested_key[0] if i.nested_key else i.key: json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = [(h["_step"], round(h["loss"], 4)) for h in history if "loss" in h]
    assert losses == [(r["step"], round(r["loss"], 4)) for r in trainer.state.log_history if "loss" in r]

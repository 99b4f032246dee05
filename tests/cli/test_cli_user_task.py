"""The same ``--model``/``--data`` factories work in ``mixprec train``, ``mixprec bench`` and ``mixprec doctor``."""

from __future__ import annotations

import json

import pytest

from mixprec.cli import main

from toys import EXAMPLES

FACTORIES = ["--model", "user_task:model", "--data", "user_task:data"]  # data() returns {"train", "validation"}


@pytest.mark.slow
def test_one_pair_of_factories_runs_in_train_bench_and_doctor(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    rc = main(["train", *FACTORIES, "--output-dir", str(tmp_path / "train"), "--max-steps", "4",
               "--eval-strategy", "steps", "--eval-steps", "4", "--save-strategy", "no", "--disable-tqdm", "true"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(r) for r in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows)

    rc = main(["bench", *FACTORIES, "--precisions", "fp32", "--steps", "1", "--rounds", "1", "--warmup", "0",
               "--no-memory", "--matmul-size", "64", "--device", "cpu", "--out", str(tmp_path / "bench")])
    assert rc == 0, capsys.readouterr().err
    bench = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert bench["task"]["name"] == "user_task:model" and bench["results"]["fp32"]["status"] == "ok"
    assert "training data" not in bench["task"]["description"]  # the validation split is the eval set

    rc = main(["doctor", *FACTORIES, "--steps", "2", "--cpu", "--out", str(tmp_path / "doctor")])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "doctor" / "report.json").read_text())
    assert report["task"] == "user_task:model" and len(report["probes"]["fp32"]["losses"]) == 2

"""``mixprec env`` prints the capability report as a table and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from mixprec.cli import main


def test_env_prints_a_table_with_every_precision(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "cpu", "fp32", "fp16-mixed", "bf16-mixed", "bf16-true", "auto"):
        assert word in out
    assert "native" in out


def test_env_json_is_valid_and_complete(capsys):
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cpu = report["devices"][0]
    assert cpu["device"] == "cpu"
    assert set(cpu["support"]) == {"fp32", "fp16-mixed", "bf16-mixed", "bf16-true", "fp8"}
    assert report["auto"]["precision"] in {"fp32", "fp16-mixed", "bf16-mixed"}


def test_console_script_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "mixprec.cli", "env", "--json"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out)["torch"]


def test_help_has_an_example(capsys):
    try:
        main(["env", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "Example" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out

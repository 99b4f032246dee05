"""``mixprec run``: a script, a module or a command written for transformers' Trainer runs, unchanged,
on mixprec's Accelerator, in ``mixprec run``'s process and in the Python processes it starts
(``accelerate launch``, ``torchrun``, trl's command line), with ``--precision`` over its arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.cli.run import split_argv

from toys import SCRIPTS

pytest.importorskip("transformers")
SCRIPT = SCRIPTS / "hf_trainer_script.py"
MIXPREC = [sys.executable, "-m", "mixprec.cli"]


def mixprec_run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*MIXPREC, "run", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def trained(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("TRAINED")]


def test_a_script_for_transformers_trainer_trains_on_mixprec_in_the_precision_asked(tmp_path):
    assert trained(mixprec_run(str(SCRIPT), str(tmp_path))) == [["mixprec.accelerator.accelerator", "fp16", "True"]]
    assert trained(mixprec_run("--precision", "bf16", str(SCRIPT), str(tmp_path))) == [
        ["mixprec.accelerator.accelerator", "bf16", "True"]]


def test_a_module_runs_as_python_m_runs_it(tmp_path):
    proc = mixprec_run("-m", "hf_trainer_script", str(tmp_path), env={"PYTHONPATH": str(SCRIPTS)})
    assert trained(proc) == [["mixprec.accelerator.accelerator", "fp16", "True"]]


def test_the_processes_accelerate_launch_starts_train_on_mixprec_too(tmp_path):
    bin_dir = str(Path(sys.executable).parent)  # accelerate's command, installed beside this python
    proc = mixprec_run("--precision", "bf16", "accelerate", "launch", "--cpu", "--num_processes", "1",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT),
                       str(tmp_path), env={"PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")})
    assert trained(proc) == [["mixprec.accelerator.accelerator", "bf16", "True"]]


def test_the_programs_warnings_are_shown_as_python_shows_them_and_only_mixprecs_as_mixprecs(tmp_path):
    script = tmp_path / "warns.py"
    script.write_text("import warnings\nimport mixprec\n"
                      "warnings.warn('x', FutureWarning)\n"
                      "warnings.warn('y', mixprec.PrecisionPerformanceWarning)\n")
    for proc in (mixprec_run(str(script)), mixprec_run("-m", "warns", env={"PYTHONPATH": str(tmp_path)})):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"{script}:3: FutureWarning: x" in proc.stderr and "mixprec: warning: x" not in proc.stderr
        assert "mixprec: warning: y" in proc.stderr


def test_a_run_says_each_precision_warning_once(tmp_path):
    from mixprec.hardware import detect_capability

    proc = mixprec_run("--precision", "fp16", str(SCRIPT), str(tmp_path))
    assert trained(proc) == [["mixprec.accelerator.accelerator", "fp16", "True"]]
    emulated = not detect_capability("cpu").is_native("fp16-mixed")
    assert proc.stderr.count("fp16-mixed on cpu works but will be slow") == emulated


def test_a_python_process_that_never_trains_imports_nothing_of_it():
    proc = mixprec_run(sys.executable, "-c", "import sys; print('LOADED', 'torch' in sys.modules, 'mixprec' in sys.modules)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED False False" in proc.stdout


def test_a_sitecustomize_the_environment_had_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.SITE_RAN = True\n")
    proc = mixprec_run(sys.executable, "-c", "import builtins; print('SITE', getattr(builtins, 'SITE_RAN', False))",
                       env={"PYTHONPATH": str(tmp_path)})
    assert "SITE True" in proc.stdout, proc.stderr[-2000:]


def test_bad_input_says_what_to_give():
    none = mixprec_run()
    assert none.returncode == 2 and "give a script, -m MODULE, or a command" in none.stderr
    missing = mixprec_run("no_such_script.py")
    assert missing.returncode == 2 and "no such script: no_such_script.py" in missing.stderr
    unknown = mixprec_run("no-such-command-here")
    assert unknown.returncode == 2 and "neither a script nor a command" in unknown.stderr
    bad = mixprec_run("--precision", "bf17", str(SCRIPT))
    assert bad.returncode == 2 and "bf16-mixed" in bad.stderr  # the valid names


def test_what_follows_the_script_is_the_scripts():
    assert split_argv(["run", "--precision", "bf16", "train.py", "--precision", "x", "-m"]) == (
        ["run", "--precision", "bf16"], ["train.py", "--precision", "x", "-m"])
    assert split_argv(["run", "-m", "pkg.train", "--epochs", "3"]) == (["run", "-m", "pkg.train"], ["--epochs", "3"])
    assert split_argv(["run", "--precision=fp16", "trl", "sft", "--bf16"]) == (["run", "--precision=fp16"],
                                                                                ["trl", "sft", "--bf16"])

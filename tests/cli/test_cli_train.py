"""``mixprec train``: example configs run, bad configs are refused before any work, Ctrl-C and SIGTERM resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixprec.cli import main
from mixprec.cli.run_config import ConfigError, load_config, parse_overrides

from toys import EXAMPLES

FAST = ["--max-steps", "6", "--eval-steps", "3", "--save-steps", "3", "--disable-tqdm", "true",
        "--num-train-epochs", "1", "--eval-strategy", "steps", "--save-strategy", "steps",
        "--load-best-model-at-end", "false"]


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_each_example_config_trains(tmp_path, example, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    out = tmp_path / "run"
    small = ["--task.max_bytes", "100000", "--task.eval_max_bytes", "8000"] if example.startswith("pycode") else []
    rc = main(["train", str(EXAMPLES / example), "--output-dir", str(out), *FAST, *small])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows)
    assert "done: 6 steps" in capsys.readouterr().out


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, flags, match", [
    ('[task]\nname = "pycode"\n[training]\nlearnig_rate = 1e-3\n', [], r"c.toml:4: \[training\] learnig_rate: unknown key; valid keys: output_dir"),
    ('[task]\nname = "pycode"\n[training]\nmax_steps = "ten"\n', [], r"c.toml:4: \[training\] max_steps: expected int, got str"),
    ('[task]\nname = "pycode"\n\n[trainig]\nx = 1\n', [], r"c.toml:4: \[trainig\]: unknown table; valid tables"),
    ('[task]\nname = "pycod"\n', [], r"c.toml:2: \[task\] name: unknown task 'pycod'; the built-in tasks are \['pycode', 'digits'\]"),
    ('[task]\nname = "pycode"\nsize = "huge"\n', [], r"c.toml:3: \[task\] size: unknown pycode size 'huge'; choose one of \['tiny', 'mini', 'small'\]"),
    ('[task]\nname = "digits"\nsize = "tiny"\n', [], r"c.toml:3: \[task\] size: unknown option\(s\) \['size'\] for the digits task; the options are \['arch', 'seed'\]"),
    ('[task]\nmodel = "a.b:c"\n', [], r"needs both model and data"),
    ('[task]\nname = "pycode"\n[precision]\nname = "fp12"\n', [], r"c.toml:4: \[precision\] name: unknown precision 'fp12'. Valid names"),
    ('[task]\nname = "pycode"\n[training]\nfp16 = true\nbf16 = true\n', [], r'c.toml:4: \[training\] fp16: the precision is set in one place, \[precision\]: name = "fp16-mixed"'),
    ('[task]\nname = "pycode"\n[training]\nresume_from_checkpoint = "nope/ckpt"\n', [], r"nope/ckpt does not exist"),
    ('[task]\nname = "pycode"\n', ["--max-steps", "x"], r"\[training\] max_steps \(from the command line\): expected int"),
    ('[task]\nname = "pycode"\n', ["--learnig-rate", "1"], r"unknown option --learnig-rate"),
    ('[task]\nname = "pycode"\n', ["--max-steps"], r"--max-steps needs a value"),
    ('[task\nname = "pycode"\n', [], r"not valid TOML.*line 1"),
])
def test_bad_configs_are_rejected_naming_key_file_line_and_choices(tmp_path, text, flags, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text), flags)


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_flags_win_over_the_file(tmp_path):
    cfg = load_config(write(tmp_path, '[task]\nname = "pycode"\n[training]\nmax_steps = 5\nlearning_rate = 0.1\n'),
                      ["--max-steps", "7", "--precision", "bf16", "--task.size", "tiny"])
    assert cfg.training.max_steps == 7 and cfg.training.learning_rate == 0.1
    assert cfg.training.precision == "bf16" and cfg.task.as_table() == {"name": "pycode", "size": "tiny"}


def test_the_cli_prints_config_errors_without_a_traceback(tmp_path, capsys):
    rc = main(["train", str(write(tmp_path, '[task]\nname = "pycode"\n[training]\nmax_steps = -5\n'))])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("mixprec train: error:") and "Traceback" not in err and "max_steps" in err


def test_a_user_factory_that_does_not_import_is_a_config_error(tmp_path, capsys):
    rc = main(["train", "--model", "no_such_module:model", "--data", "no_such_module:data",
               "--output-dir", str(tmp_path)])
    assert rc == 2 and "no_such_module" in capsys.readouterr().err


_keys = st.sampled_from(["task", "training", "precision", "diagnostics", "name", "size", "max_steps", "fp16",
                         "learning_rate", "output_dir", "x", "loss_scaler", "eval_strategy", "model"])
_values = st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), st.booleans(), st.text(max_size=8),
                    st.just('"pycode"'), st.just('"tiny"'), st.just("[1, 2]"), st.just("{ a = 1 }"))


@st.composite
def toml_documents(draw):
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            lines.append(f"[{draw(_keys)}]")
        value = draw(_values)
        value = json.dumps(value) if isinstance(value, str) and not value.startswith(("[", "{", '"')) else value
        value = str(value).lower() if isinstance(value, bool) else value
        lines.append(f"{draw(_keys)} = {value}")
    if draw(st.booleans()):
        lines.append(draw(st.text(max_size=20)))
    return "\n".join(lines)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=toml_documents(), flags=st.lists(st.one_of(st.sampled_from(["--max-steps", "--precision", "--task", "--x",
                                                                       "--training.fp16", "--size", "-q", "--"]),
                                                      st.text(max_size=6)), max_size=6))
def test_arbitrary_toml_and_flags_give_only_config_errors(tmp_path, doc, flags):
    path = tmp_path / "h.toml"
    path.write_text(doc)
    try:
        cfg = load_config(path, flags)
    except ConfigError:
        return
    assert cfg.task  # what passes is a complete, checked configuration


def test_parse_overrides_reads_values_as_toml():
    assert parse_overrides(["--learning-rate", "1e-3", "--fp16", "true", "--output-dir=runs/x"]) == {
        "training": {"learning_rate": 1e-3, "fp16": True, "output_dir": "runs/x"}}


def _train_until_signalled(out: Path, sig: int) -> tuple[list[str], int, str, str]:
    """Start a long `mixprec train` into ``out``, send it ``sig`` once it has logged and trained a
    second more; returns the command (without --max-steps, to resume with), its status and output."""
    base = [sys.executable, "-m", "mixprec.cli", "train", str(EXAMPLES / "pycode-tiny.toml"), "--task.max_bytes",
            "100000", "--output-dir", str(out), "--save-strategy", "no", "--eval-strategy", "no", "--disable-tqdm", "true",
            "--logging-steps", "1"]
    proc = subprocess.Popen([*base, "--max-steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return base, proc.returncode, stdout, stderr


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_that_resume_continues(tmp_path):
    out = tmp_path / "run"
    base, returncode, stdout, stderr = _train_until_signalled(out, signal.SIGINT)
    assert returncode == 130, stderr[-2000:]
    assert "stopped by Ctrl-C" in stdout and "--resume" in stdout
    ckpts = list(out.glob("checkpoint-*"))
    assert len(ckpts) == 1
    step = int(ckpts[0].name.split("-")[1])
    rc = subprocess.run([*base, "--max-steps", str(step + 3), "--resume"],
                        capture_output=True, text=True, timeout=120, env={**os.environ})
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert f"done: {step + 3} steps" in rc.stdout


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_exits_75_and_resume_continues(tmp_path):
    """A scheduler's preemption: SIGTERM to `mixprec train` finishes the step, writes a checkpoint at
    it, logs one line, exits with status 75; --resume continues from it, logging each step once."""
    out = tmp_path / "run"
    base, returncode, stdout, stderr = _train_until_signalled(out, signal.SIGTERM)
    assert returncode == 75, stderr[-2000:]
    ckpts = list(out.glob("checkpoint-*"))
    assert len(ckpts) == 1  # save_strategy="no": the preemption's checkpoint alone
    step = int(ckpts[0].name.split("-")[1])
    told = [line for line in stderr.splitlines() if "SIGTERM" in line]
    assert len(told) == 1 and f"stopped after step {step} with a checkpoint" in told[0], stderr[-2000:]
    assert f"stopped by SIGTERM at step {step}" in stdout and "--resume" in stdout
    logged = [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))  # nothing logged past the checkpoint
    rc = subprocess.run([*base, "--max-steps", str(step + 3), "--resume"], capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr[-2000:]
    assert f"done: {step + 3} steps" in rc.stdout
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, step + 4))


def test_the_diagnostics_table_reaches_the_trainer_and_its_rows_are_logged(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = write(tmp_path, '[task]\nname = "digits"\n[training]\nmax_steps = 4\nlogging_steps = 1\n'
                          'save_strategy = "no"\ndisable_tqdm = true\n[precision]\nname = "bf16"\n'
                          '[diagnostics]\nsteps = 1\ntrace_overflow = true\n')
    rc = main(["train", str(cfg), "--output-dir", str(out), "--drift-steps", "2"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("grad_fp16_flush" in r for r in rows) and any("drift_rel" in r for r in rows)


def test_each_setting_has_one_table_and_a_flag_named_after_its_field(tmp_path):
    cfg = load_config(None, ["--task", "digits", "--diagnostics-steps", "5", "--trace-overflow", "true",
                             "--loss-scaler", "{ init_scale = 1024.0 }", "--precision", "fp16", "--task.seed", "3"])
    assert (cfg.training.diagnostics_steps, cfg.training.trace_overflow) == (5, True)
    assert cfg.diagnostics == {"steps": 5, "trace_overflow": True, "drift_steps": 0}
    assert cfg.training.loss_scaler == {"init_scale": 1024.0} and cfg.precision == "fp16"
    assert cfg.task.as_table() == {"name": "digits", "seed": 3} and cfg.training.seed == 42
    with pytest.raises(ConfigError, match=r"c.toml:4: \[training\] precision: set it in \[precision\] as name"):
        load_config(write(tmp_path, '[task]\nname = "digits"\n[training]\nprecision = "bf16"\n'))
    with pytest.raises(ConfigError, match=r"c.toml:4: \[diagnostics\] steps: diagnostics_steps"):
        load_config(write(tmp_path, '[task]\nname = "digits"\n[diagnostics]\nsteps = -1\n'))


def test_model_and_data_flags_replace_the_files_built_in_task(tmp_path):
    cfg = load_config(write(tmp_path, '[task]\nname = "pycode"\nsize = "tiny"\n'),
                      ["--model", "user_task:model", "--data", "user_task:data"])
    assert cfg.task.as_table() == {"model": "user_task:model", "data": "user_task:data"}

"""``mixprec bench`` measures one job under each precision and writes a table, bench.json and a PNG."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import sys
import types
import warnings

import pytest
import torch

import mixprec.apps.bench as bench
from mixprec.apps.bench import BenchConfig, run_bench
from mixprec.apps.bench.config import build_job
from mixprec.apps.bench.rivals import TorchLoopRunner
from mixprec.cli import main
from mixprec.cli.bench import format_table
from mixprec.hardware import detect_capability
from mixprec.precision import PrecisionPerformanceWarning

# Tiny on purpose: the machines are shared; the numbers only have to be there and make sense.
TINY = ["--size", "tiny", "--steps", "2", "--rounds", "2", "--warmup", "1", "--batch-size", "4",
        "--matmul-size", "128", "--device", "cpu"]
TINY_CONFIG = dict(size="tiny", steps=2, rounds=2, warmup=1, batch_size=4, matmul_size=128, device="cpu",
                   memory=False)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", *TINY, "--precisions", "fp32,bf16-mixed", "--out", str(out)])
    return code, stdout.getvalue(), out


@pytest.mark.slow
def test_bench_prints_a_table_with_a_row_per_precision(bench_run):
    code, stdout, _ = bench_run
    assert code == 0
    for word in ("precision", "step ms", "samples/s", "tokens/s", "speed-up", "peak MiB", "TFLOP/s", "% of peak",
                 "train loss", "eval loss", "fp32", "bf16-mixed", "matmul peak"):
        assert word in stdout
    rows = [line for line in stdout.splitlines() if line.startswith(("fp32 ", "bf16-mixed "))]
    assert len(rows) == 2


@pytest.mark.slow
def test_bench_json_holds_the_machine_the_command_and_finite_positive_numbers(bench_run):
    _, _, out = bench_run
    result = json.loads((out / "bench.json").read_text())
    for key in ("machine", "config", "task", "baseline", "matmul_peak_tflops", "memory_method", "results", "notes",
                "command"):
        assert key in result
    assert {"device", "device_name", "torch", "threads"} <= set(result["machine"])
    assert result["command"].startswith("mixprec bench ")
    assert result["baseline"] == "fp32"
    assert set(result["matmul_peak_tflops"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in result["matmul_peak_tflops"].values())
    for name in ("fp32", "bf16-mixed"):
        row = result["results"][name]
        assert row["status"] == "ok"
        for key in ("step_time_s", "samples_per_s", "tokens_per_s", "speedup", "peak_memory_bytes", "tflops",
                    "fraction_of_peak", "flops_per_step", "train_loss", "eval_loss"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (name, key)
        assert math.isfinite(row["train_loss_rel_diff"]) and math.isfinite(row["eval_loss_rel_diff"])
        assert len(row["step_times_s"]) == 2 * 2  # steps x rounds
        # tokens = batch x sequence length for pycode
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 64)
    assert result["results"]["fp32"]["flops_per_step"] == result["results"]["bf16-mixed"]["flops_per_step"]


@pytest.mark.slow
def test_each_row_counts_the_host_syncs_of_one_step_and_fused_adamw_steps_need_none(bench_run):
    code, stdout, out = bench_run
    assert "syncs" in stdout
    result = json.loads((out / "bench.json").read_text())
    assert [r["host_syncs_per_step"] for r in result["results"].values()] == [0, 0]


@pytest.mark.slow
def test_bench_png_is_a_valid_image_matplotlib_can_read(bench_run):
    _, _, out = bench_run
    data = (out / "bench.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out / "bench.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.slow
def test_fp32_speedup_over_itself_is_exactly_one(bench_run):
    _, _, out = bench_run
    row = json.loads((out / "bench.json").read_text())["results"]["fp32"]
    assert row["speedup"] == 1.0 and row["speedup_fastest_steps"] == 1.0
    assert row["train_loss_rel_diff"] == 0.0 and row["eval_loss_rel_diff"] == 0.0


def test_speedup_is_the_median_of_the_per_round_ratios_and_drift_is_said_in_the_notes():
    def row(per_round, fastest):
        return {"status": "ok", "runner": "mixprec", "precision": "fp32", "train_loss": 1.0, "eval_loss": 1.0,
                "step_time_per_round_s": per_round, "step_time_min_s": fastest,
                "round_spread": max(per_round) / min(per_round)}

    # The machine slowed 4x in round 3 while fp32 ran, and in round 2 while bf16 ran.
    rows = {"fp32": row([1.0, 1.0, 4.0], 1.0), "bf16-mixed": row([0.5, 2.0, 0.5], 0.5)}
    bench.add_ratios(rows, "fp32")
    assert rows["fp32"]["speedup"] == 1.0
    assert rows["bf16-mixed"]["speedup"] == 2.0  # median of 2.0, 0.5 and 8.0
    assert rows["bf16-mixed"]["speedup_fastest_steps"] == 2.0
    (note,) = bench.drift_note(rows)
    assert "speed changed during the run" in note and "bf16-mixed 2.00x" in note
    steady = {"fp32": row([1.0, 1.1, 1.0], 1.0), "bf16-mixed": row([0.5, 0.5, 0.55], 0.5)}
    bench.add_ratios(steady, "fp32")
    assert bench.drift_note(steady) == []


def test_bad_precision_name_is_an_error_that_lists_the_valid_names(capsys):
    assert main(["bench", "--precisions", "fp32,fp12", "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec bench: error: ")
    assert "fp12" in err and "Valid names" in err and "bf16-mixed" in err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match="Valid names"):
        BenchConfig(precisions=("fp12",))


def test_compare_with_an_unknown_name_is_an_error_listing_all_four(capsys):
    assert main(["bench", "--compare", "hf,deepspeed", "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec bench: error: ") and "deepspeed" in err
    assert "torch, trainer, hf, accelerate" in err
    with pytest.raises(ValueError, match="unknown compare name"):
        BenchConfig(compare=("torchtitan",))


@pytest.mark.slow
def test_precision_the_device_cannot_run_is_reported_as_skipped_with_the_reason(monkeypatch):
    real = bench.runners.Accelerator

    def accelerator(mixed_precision=None, **kwargs):
        if mixed_precision == "bf16-true":
            raise ValueError("precision 'bf16-true' is not supported on cpu: (a device without bf16)")
        return real(mixed_precision=mixed_precision, **kwargs)

    monkeypatch.setattr(bench.runners, "Accelerator", accelerator)  # where mixprec_runner looks it up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_bench(BenchConfig(precisions=("fp32", "fp16-mixed", "bf16-true"), **TINY_CONFIG))
    rows = result["results"]
    assert rows["bf16-true"]["status"] == "skipped"
    assert "not supported on cpu" in rows["bf16-true"]["reason"]
    assert rows["fp32"]["status"] == rows["fp16-mixed"]["status"] == "ok"
    # fp16 on a CPU without AMX-FP16 is said once, in the notes, not as a warning per call site.
    assert not [w for w in caught if issubclass(w.category, PrecisionPerformanceWarning)]
    if detect_capability("cpu").support["fp16-mixed"] == "emulated":
        assert any(n.startswith("fp16-mixed is emulated here") for n in result["notes"])


@pytest.mark.slow
def test_by_default_precisions_the_device_runs_impractically_slowly_are_left_out_with_a_note(monkeypatch):
    import dataclasses as dc

    real = detect_capability("cpu")
    slow = {p: f"{p} crawls here" for p in ("fp16-mixed", "bf16-mixed", "bf16-true")}
    monkeypatch.setattr(bench.core, "detect_capability", lambda device=None: dc.replace(real, impractical=slow))
    result = run_bench(BenchConfig(**TINY_CONFIG))
    assert list(result["results"]) == ["fp32"] and list(result["config"]["precisions"]) == ["fp32"]
    assert "fp16-mixed left out: fp16-mixed crawls here (name it in --precisions to run it anyway)" in result["notes"]
    named = run_bench(BenchConfig(precisions=("fp32", "bf16"), **TINY_CONFIG))  # asked for: run
    assert named["results"]["bf16-mixed"]["status"] == "ok"
    assert not any("left out" in n for n in named["notes"])


def test_a_users_task_from_factories_runs_and_counts_its_tokens():
    result = run_bench(BenchConfig(model="toys:TinyLM", data="toys:LMData", precisions=("fp32", "bf16"),
                                   steps=2, rounds=1, warmup=0, batch_size=8, matmul_size=128, memory=False,
                                   device="cpu"))
    row = result["results"]["bf16-mixed"]
    assert row["status"] == "ok"
    assert result["task"]["tokens_per_sample"] == 12
    assert "eval loss on the training data" in result["task"]["description"]


def test_a_users_factory_that_does_not_exist_is_an_error_naming_it(capsys):
    assert main(["bench", "--model", "toys:NoSuchModel", "--data", "toys:LMData", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec bench: error: ") and "NoSuchModel" in err


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "mixprec bench --" in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs transformers and accelerate (the hf extra)")
def test_hugging_face_runs_train_the_same_model_on_the_same_data_as_mixprec():
    result = run_bench(BenchConfig(precisions=("bf16-mixed",), compare=("hf", "accelerate"), **TINY_CONFIG))
    rows = result["results"]
    ours = rows["bf16-mixed"]
    for name in ("hf-trainer bf16-mixed", "accelerate bf16-mixed"):
        assert rows[name]["status"] == "ok", rows[name].get("reason")
        assert len(rows[name]["step_times_s"]) == 2 * 2
        # Same init, same data order, same optimizer: the same losses, give or take bf16 rounding.
        assert rows[name]["train_loss"] == pytest.approx(ours["train_loss"], rel=1e-3)
        assert rows[name]["throughput_vs_mixprec"] > 0


@pytest.mark.slow
def test_the_torch_loop_and_mixprecs_trainer_train_the_same_model_on_the_same_data_as_the_accelerator():
    result = run_bench(BenchConfig(precisions=("fp32",), compare=("torch", "trainer"), **TINY_CONFIG))
    rows = result["results"]
    ours, loop, trainer = rows["fp32"], rows["torch-loop fp32"], rows["mixprec-trainer fp32"]
    for row in (loop, trainer):
        assert row["status"] == "ok", row.get("reason")
        assert row["runner"] in ("torch-loop", "mixprec-trainer") and row["precision"] == "fp32"
        assert len(row["step_times_s"]) == 2 * 2
        # Same init, same data order, same fused AdamW, all in fp32: the same numbers, to rounding.
        assert row["train_loss"] == pytest.approx(ours["train_loss"], rel=1e-5)
        assert row["eval_loss"] == pytest.approx(ours["eval_loss"], rel=1e-5)
        assert row["flops_per_step"] == ours["flops_per_step"]
        assert row["throughput_vs_mixprec"] > 0
    # Each row's throughput over the hand-written loop's, where torch was compared; not the loop's own.
    assert ours["throughput_vs_torch_loop"] > 0 and trainer["throughput_vs_torch_loop"] > 0
    assert "throughput_vs_torch_loop" not in loop
    assert "vs torch loop" in format_table(result)


def test_the_torch_loop_uses_torchs_own_grad_scaler_for_fp16_and_a_bf16_cast_model_for_bf16_true():
    config = BenchConfig(**TINY_CONFIG)
    job = build_job(config)
    fp16 = TorchLoopRunner(job, "fp16-mixed", config, torch.device("cpu"), [])
    fp16.run_chunk(2)
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler.get_scale() > 0
    assert all(p.dtype == torch.float32 for p in fp16.model.parameters())
    true = TorchLoopRunner(job, "bf16-true", config, torch.device("cpu"), [])
    true.run_chunk(2)
    assert true.scaler is None and all(p.dtype == torch.bfloat16 for p in true.model.parameters())
    assert type(true.opt) is torch.optim.AdamW  # no compensation: what torch alone offers
    assert all(math.isfinite(float(loss)) for loss in fp16.losses + true.losses)


@pytest.mark.slow
def test_bf16_true_gives_a_row_per_compensation_named_after_the_first():
    result = run_bench(BenchConfig(precisions=("bf16-true",), bf16_true_compensation=("kahan", "stochastic", "none"),
                                   bf16_true_state_dtype="bf16", compare=("trainer",), **TINY_CONFIG))
    rows = result["results"]
    assert list(rows) == ["bf16-true", "bf16-true (stochastic)", "bf16-true (none)", "mixprec-trainer bf16-true"]
    for name, comp in (("bf16-true", "kahan"), ("bf16-true (stochastic)", "stochastic"), ("bf16-true (none)", "none")):
        row = rows[name]
        assert row["status"] == "ok", row.get("reason")
        assert (row["precision"], row["compensation"], row["state_dtype"]) == ("bf16-true", comp, "bf16")
    assert "kahan" in rows["bf16-true"]["optimizer"] and "stochastic" in rows["bf16-true (stochastic)"]["optimizer"]
    assert "bf16 moments" in rows["bf16-true"]["optimizer"]
    # The compared Trainer's twin is the first row, and it trains the same variant.
    assert rows["mixprec-trainer bf16-true"]["throughput_vs_mixprec"] > 0
    assert rows["mixprec-trainer bf16-true"]["optimizer"] == rows["bf16-true"]["optimizer"]


def test_bf16_true_options_are_checked_and_the_errors_list_the_valid_values(capsys):
    with pytest.raises(ValueError, match="kahan, stochastic, none"):
        BenchConfig(bf16_true_compensation=("kahan", "fp8-rounding"))
    with pytest.raises(ValueError, match="name at least one"):
        BenchConfig(bf16_true_compensation=())
    with pytest.raises(ValueError, match="'fp32', 'bf16'"):
        BenchConfig(bf16_true_state_dtype="fp16")
    assert BenchConfig(bf16_true_compensation="none").bf16_true_compensation == ("none",)
    assert main(["bench", "--bf16-true-compensation", "kahan,exact", "--out", "/nonexistent/never-written"]) == 2
    assert "kahan, stochastic, none" in capsys.readouterr().err


def test_the_cpu_memory_probe_builds_the_rows_bf16_true_variant(monkeypatch):
    built = []
    real = bench.memory.mixprec_runner

    def spy(job, precision, config, device, compensation=None):
        runner = real(job, precision, config, device, compensation)
        built.append((precision, compensation, runner))
        return runner

    def in_process(cmd, input, **kwargs):  # the fresh process's work, run here
        monkeypatch.setattr(sys, "stdin", io.StringIO(input))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.memory.memory_probe_main()
        return types.SimpleNamespace(stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(bench.memory, "mixprec_runner", spy)
    monkeypatch.setattr(bench.memory.subprocess, "run", in_process)
    config = BenchConfig(precisions=("bf16-true",), bf16_true_state_dtype="bf16", memory_steps=1,
                         **{**TINY_CONFIG, "memory": True})
    tensors, _, _ = bench.memory.cpu_peak_memory(config, {"precision": "bf16-true", "compensation": "stochastic"})
    assert tensors is None or tensors > 0
    ((precision, compensation, runner),) = built
    assert (precision, compensation) == ("bf16-true", "stochastic")
    assert "stochastic" in runner.optimizer
    state = next(iter(runner.opt.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16


@pytest.mark.slow
def test_compile_builds_every_contestant_compiled_and_they_still_train_alike():
    result = run_bench(BenchConfig(precisions=("bf16-mixed",), compare=("torch", "trainer"), compile=True,
                                   **{**TINY_CONFIG, "rounds": 1}))
    rows = result["results"]
    assert result["config"]["compile"] is True
    for name in ("bf16-mixed", "torch-loop bf16-mixed", "mixprec-trainer bf16-mixed"):
        assert rows[name]["status"] == "ok", rows[name].get("reason")
        assert rows[name]["train_loss"] == pytest.approx(rows["bf16-mixed"]["train_loss"], rel=1e-2)
    assert any("compiled alike" in n for n in result["notes"])

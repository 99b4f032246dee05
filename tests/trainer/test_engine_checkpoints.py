"""transformers' own Trainer under the switch keeps mixprec's checkpoint promises: a kill (random,
or inside a save; one rank of two), SIGTERM (one rank of two too) and a full disk lose nothing, the
restart with the example scripts' ``get_last_checkpoint`` ends bit for bit as the uninterrupted run,
a damaged checkpoint is never resumed in silence, and the files stay transformers' (stock
transformers resumes them, and the switch resumes stock transformers'). The killed runs are
``tests/scripts/engine_run.py`` (a 2-layer GPT-2, saving every 2 steps) in their own processes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec.checkpoint import CheckpointError, verify_checkpoint

from toys import SCRIPTS, Preloaded, SineRegressor, SineRows, torchrun

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.xdist_group("engine_checkpoints"),
              pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")]

SCRIPT = SCRIPTS / "engine_run.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
KILLED = -signal.SIGKILL


#: One process's runs start forked from one that has imported transformers' Trainer (each run is
#: still a process of its own, killed and restarted as a process): seconds of import saved a start.
PRELOADED = Preloaded("torch", "transformers", "transformers.trainer", "transformers.trainer_utils")


def _run(out: Path, *flags: str, ranks: int = 1, expect: int | None = 0, start_only: bool = False):
    if ranks > 1:
        proc = subprocess.run(torchrun(SCRIPT, str(out), *flags, nproc=ranks), capture_output=True, text=True,
                              timeout=300, env=ENV)
    else:
        if start_only:
            return PRELOADED.start(SCRIPT, str(out), *flags, env=ENV, logs=out.parent)
        proc = PRELOADED.run(SCRIPT, str(out), *flags, env=ENV, logs=out.parent, timeout=300)
    if expect is not None:
        assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _result(out: Path, rank: int = 0) -> dict:
    return json.loads((out / f"result-{rank}.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses and weights, by (precision, flags...), made once."""
    made = {}

    def get(precision: str, *flags: str, ranks: int = 1) -> list[dict]:
        # how many checkpoints are kept changes nothing the run computes: one reference for all
        limit = flags.index("--save-total-limit") if "--save-total-limit" in flags else None
        key = (precision, flags if limit is None else flags[:limit] + flags[limit + 2:], ranks)
        if key not in made:
            out = tmp_path_factory.mktemp("reference")
            _run(out / "run", precision, *flags, ranks=ranks)
            made[key] = [_result(out / "run", r) for r in range(ranks)]
        return made[key]
    return get


def _same(ours: dict, theirs: dict) -> None:
    assert ours["losses"] == theirs["losses"]
    assert ours["weights"] == theirs["weights"]


def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.iterdir() if p.name.startswith("checkpoint-")), key=lambda n: int(n[11:]))


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "limit"), [("fp32", 1), ("bf16", 2), ("fp16", 2)])
def test_a_kill_inside_a_save_leaves_the_last_checkpoint_and_the_restart_ends_bit_for_bit(
        tmp_path, reference, precision, limit):
    out = tmp_path / "run"
    flags = (precision, "--save-total-limit", str(limit))
    proc = _run(out, *flags, "--kill-in-save", "6", expect=KILLED)
    assert proc.returncode == KILLED
    # the save of checkpoint-6 was cut after the weights: no folder of that name, the older ones whole
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4"][-limit:]
    assert transformers.trainer_utils.get_last_checkpoint(str(out)) == str(out / "checkpoint-4")
    verify_checkpoint(out / "checkpoint-4")
    _run(out, *flags)
    assert _result(out)["resumed_from"] == str(out / "checkpoint-4")
    _same(_result(out), reference(*flags)[0])


def _random_kills(tmp_path: Path, reference, kills: int, seed: int) -> None:
    """Kill the run ``kills`` times at random moments of its training (60 steps, a save every 2),
    each once its first checkpoint of that start is there, then let it finish."""
    out, rng, flags = tmp_path / "run", random.Random(seed), ("fp32", "--max-steps", "60")
    done = 0
    while done < kills:
        before = set(_checkpoints(out)) if out.exists() else set()
        proc = _run(out, *flags, start_only=True)
        while proc.poll() is None and (not out.exists() or set(_checkpoints(out)) <= before):
            time.sleep(0.01)  # until this start saves (the import takes seconds, training about one)
        time.sleep(rng.uniform(0.0, 0.6))
        proc.kill()
        proc.wait(timeout=60)
        if (out / "result-0.json").exists():  # it ended before the kill: start over
            shutil.rmtree(out)
            continue
        done += 1
        for name in _checkpoints(out):  # whatever the moment, every folder under a checkpoint name is whole
            verify_checkpoint(out / name)
    _run(out, *flags)
    _same(_result(out), reference(*flags)[0])


@pytest.mark.slow
def test_random_kills_then_a_restart_end_bit_for_bit(tmp_path, reference):
    _random_kills(tmp_path, reference, kills=2, seed=0)


@pytest.mark.soak
def test_many_random_kills_then_a_restart_end_bit_for_bit(tmp_path, reference):
    _random_kills(tmp_path, reference, kills=int(os.environ.get("MIXPREC_SOAK_KILLS", "20")), seed=1)


@pytest.mark.slow
def test_sigterm_stops_at_the_next_step_saves_it_exits_75_and_the_restart_ends_bit_for_bit(tmp_path, reference):
    out = tmp_path / "run"
    proc = _run(out, "fp16", "--sigterm-at", "5", expect=75)
    assert "SIGTERM received; stopped after step 5" in proc.stderr
    assert _checkpoints(out)[-1] == "checkpoint-5"  # not a save step: the one the SIGTERM made
    verify_checkpoint(out / "checkpoint-5")
    _run(out, "fp16")
    _same(_result(out), reference("fp16")[0])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank run through two faults, each restart resuming what the fault left: rank 1 is
    SIGKILLed inside the save at step 6; the restart gets a SIGTERM on rank 1 as step 9 begins;
    the last restart ends. Returns the folder, and after each fault its checkpoints and the files
    of the last one as verified then."""
    out = tmp_path_factory.mktemp("two-ranks") / "run"
    after = []
    for fault in (("--kill-in-save", "6"), ("--sigterm-at", "9")):
        proc = _run(out, "fp32", *fault, "--rank", "1", ranks=2, expect=None)
        assert proc.returncode != 0, proc.stderr[-3000:]
        names = _checkpoints(out)
        after.append((names, set(verify_checkpoint(out / names[-1]))))
    _run(out, "fp32", ranks=2)
    return out, after


@pytest.mark.slow
def test_two_ranks_one_killed_inside_a_save_restart_bit_for_bit(two_ranks, reference):
    out, after = two_ranks
    names, files = after[0]
    assert names == ["checkpoint-2", "checkpoint-4"]  # checkpoint-6's save died on rank 1: on neither rank
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= files
    for rank in range(2):  # the restart after the kill resumed there
        assert json.loads((out / f"exit-{rank}.json").read_text())["resumed_from"] == str(out / "checkpoint-4")
    for rank, theirs in enumerate(reference("fp32", ranks=2)):
        _same(_result(out, rank), theirs)


@pytest.mark.slow
def test_sigterm_to_one_of_two_ranks_stops_both_at_one_step_with_exit_75(two_ranks, reference):
    out, after = two_ranks
    exits = [json.loads((out / f"exit-{rank}.json").read_text()) for rank in range(2)]
    # rank 0 got no signal: it stopped with rank 1, at its step
    assert [(e["code"], e["step"]) for e in exits] == [(75, 9)] * 2
    names, files = after[1]
    assert names[-1] == "checkpoint-9"  # not a save step: the one the SIGTERM made
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= files
    for rank, theirs in enumerate(reference("fp32", ranks=2)):
        assert _result(out, rank)["resumed_from"] == str(out / "checkpoint-9")
        _same(_result(out, rank), theirs)


@pytest.mark.slow
def test_trls_sft_trainer_killed_inside_a_save_resumes_bit_for_bit(tmp_path, reference):
    pytest.importorskip("trl")
    out = tmp_path / "run"
    _run(out, "bf16", "--trl", "--kill-in-save", "6", expect=KILLED)
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    _run(out, "bf16", "--trl")
    _same(_result(out), reference("bf16", "--trl")[0])


# -- in this process: damage, both directions with stock transformers, a full disk ---------------------


@pytest.fixture
def switch():
    yield mixprec.patch_transformers
    mixprec.unpatch_transformers()


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _train(out, resume=None, model=None, callbacks=(), **more):
    settings = dict(output_dir=str(out), num_train_epochs=2, per_device_train_batch_size=4, learning_rate=1e-2,
                    logging_steps=1, save_strategy="steps", save_steps=5, report_to="none", disable_tqdm=True,
                    use_cpu=True, seed=3)
    torch.manual_seed(0)
    args = transformers.TrainingArguments(**{**settings, **more})
    trainer = transformers.Trainer(model=model or SineRegressor(), args=args, train_dataset=SineRows(),
                                   eval_dataset=SineRows() if args.eval_strategy != "no" else None,
                                   callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return [(r["step"], r["loss"]) for r in trainer.state.log_history if "loss" in r], weights


def _equal(a, b):
    assert a[0] == b[0]
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_a_changed_file_fails_the_resume_naming_it_and_true_falls_back_to_the_newest_good_one(
        tmp_path, switch, caplog, one_thread):
    switch()
    _train(tmp_path, callbacks=[StopAt(15)])  # checkpoints 5, 10, 15
    damaged = tmp_path / "checkpoint-15" / "optimizer.pt"
    damaged.write_bytes(damaged.read_bytes()[:-7] + b"garbage")  # the same size, other bytes
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        _train(tmp_path, resume=str(tmp_path / "checkpoint-15"))
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        resumed = _train(tmp_path, resume=True)
    assert "resuming from" in caplog.text and "checkpoint-10, the newest good checkpoint" in caplog.text
    assert "skipped checkpoint-15" in caplog.text
    mixprec.unpatch_transformers()
    _equal(resumed, _train(tmp_path / "whole"))  # from step 10, as if nothing had happened


def test_a_stock_transformers_checkpoint_resumes_under_the_switch_and_stock_resumes_the_switchs(
        tmp_path, switch, caplog, one_thread):
    whole = _train(tmp_path / "whole")
    _train(tmp_path / "stock", callbacks=[StopAt(10)])  # written by stock transformers
    switch()
    _train(tmp_path / "switched", callbacks=[StopAt(10)])  # written under the switch
    assert (tmp_path / "switched" / "checkpoint-10" / "manifest.json").is_file()
    stock_files = sorted(os.listdir(tmp_path / "stock" / "checkpoint-10"))
    assert sorted(os.listdir(tmp_path / "switched" / "checkpoint-10")) == sorted([*stock_files, "manifest.json"])
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        under_switch = _train(tmp_path / "stock", resume=str(tmp_path / "stock" / "checkpoint-10"))
    assert "has no mixprec manifest.json" in caplog.text
    mixprec.unpatch_transformers()
    by_stock = _train(tmp_path / "switched", resume=True)
    _equal(by_stock, whole)
    # the switch trains fp32 as Accelerate does: the same numbers either way
    _equal(under_switch, whole)


def test_the_best_checkpoint_is_named_where_it_is_committed(tmp_path, switch, one_thread):
    switch()
    _train(tmp_path, eval_strategy="steps", eval_steps=5, metric_for_best_model="eval_loss", greater_is_better=False,
           load_best_model_at_end=True, save_total_limit=1, num_train_epochs=1)
    state = json.loads((tmp_path / "checkpoint-10" / "trainer_state.json").read_text())
    best = state["best_model_checkpoint"]
    assert best in (str(tmp_path / "checkpoint-5"), str(tmp_path / "checkpoint-10"))
    assert Path(best).is_dir() and ".tmp-" not in best


class Wide(torch.nn.Module):
    """The sine regressor with a 128x1536 middle: a checkpoint of ~2.4 MB, so two do not fit in the 3 MiB disk."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1536),
                                        torch.nn.Tanh(), torch.nn.Linear(1536, 1))

    def forward(self, x, labels=None):
        out = self.body(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_a_full_disk_during_a_save_raises_enospc_naming_it_and_leaves_the_previous_checkpoint_whole(
        disk, switch, one_thread):
    switch()
    with pytest.raises(OSError) as caught:
        _train(disk / "out", model=Wide(), save_steps=5, num_train_epochs=1)
    assert caught.value.errno == errno.ENOSPC
    assert "checkpoint-10" in str(caught.value) and "the disk is full" in str(caught.value)
    assert sorted(os.listdir(disk / "out")) == ["checkpoint-5"]  # no partial folder, no staging left
    verify_checkpoint(disk / "out" / "checkpoint-5")

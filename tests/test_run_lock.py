"""One live run per output_dir; an unusable output_dir is refused before the first step."""

import logging
import subprocess
import sys

import pytest

from mixprec import Trainer, TrainingArguments
from mixprec.checkpoint.lock import LOCK_NAME, RunLock

from toys import Classifier, blobs


def trainer(out):
    args = TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=8, save_strategy="no",
                             disable_tqdm=True, report_to="none")
    return Trainer(model=Classifier(), args=args, train_dataset=blobs(32))


def test_a_folder_in_use_by_a_live_run_is_refused_with_its_pid(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import json
        import socket

        tmp_path.mkdir(exist_ok=True)
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname()}))
        t = trainer(tmp_path)
        with pytest.raises(RuntimeError, match=f"in use by a live run \\(pid {other.pid}"):
            t.train()
        assert t.state.global_step == 0  # nothing trained
    finally:
        other.kill()
        other.wait()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    import json
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        assert trainer(tmp_path).train().global_step == 2
    assert any("no longer running" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_first_step():
    with pytest.raises(RuntimeError, match="cannot be written.*writable output_dir"):
        trainer("/sys/mixprec-test-out").train()


def test_the_lock_is_held_only_inside_the_block(tmp_path):
    with RunLock(tmp_path) as lock:
        assert lock.path.exists()
        with pytest.raises(RuntimeError, match="in use by a live run"):
            # the same pid re-entering counts as itself; another live pid would be refused
            import json
            import os
            import socket

            lock.path.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
            RunLock(tmp_path).__enter__()
    assert not lock.path.exists()

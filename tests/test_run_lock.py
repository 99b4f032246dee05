"""One live run per output_dir (a flock the kernel drops with its process); an unusable output_dir is refused."""

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mixprec
from mixprec import Trainer, TrainingArguments
from mixprec.checkpoint import lock as lock_module
from mixprec.checkpoint.lock import LOCK_NAME, RunLock

from toys import Classifier, blobs

HOLD = "import sys, time\nfrom mixprec.checkpoint.lock import RunLock\nwith RunLock(sys.argv[1]):\n    time.sleep(120)\n"


def trainer(out):
    args = TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=8, save_strategy="no",
                             disable_tqdm=True, report_to="none")
    return Trainer(model=Classifier(), args=args, train_dataset=blobs(32))


def owner(folder: Path) -> dict:
    try:
        return json.loads((folder / LOCK_NAME).read_text())
    except (OSError, ValueError):
        return {}


def holding_child(folder: Path) -> subprocess.Popen:
    """A process of its own that takes ``folder``'s lock and sleeps (returned once it holds it)."""
    env = {**os.environ, "PYTHONPATH": str(Path(mixprec.__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env)
    deadline = time.monotonic() + 60
    while owner(folder).get("pid") != child.pid:
        assert child.poll() is None, f"the child exited with status {child.returncode} before taking the lock"
        assert time.monotonic() < deadline, "the child did not take the lock within 60 s"
        time.sleep(0.05)
    return child


def stop(child: subprocess.Popen) -> None:
    child.kill()
    child.wait(timeout=30)


def test_a_folder_locked_by_a_live_run_is_refused_with_its_pid_and_host(tmp_path):
    child = holding_child(tmp_path)
    try:
        host = socket.gethostname()
        with pytest.raises(RuntimeError, match=f"in use by a live run \\(pid {child.pid} on {host}, lock "
                                               ".*wait for it to finish, stop it, or choose another output_dir"):
            RunLock(tmp_path).__enter__()
        t = trainer(tmp_path)
        with pytest.raises(RuntimeError, match=f"in use by a live run \\(pid {child.pid}"):
            t.train()
        assert t.state.global_step == 0  # nothing trained
        assert owner(tmp_path)["pid"] == child.pid  # the refused ones changed nothing
    finally:
        stop(child)


def test_a_run_killed_and_not_yet_reaped_leaves_a_lock_that_is_taken(tmp_path, caplog):
    child = holding_child(tmp_path)
    try:
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        # Wait for its death without reaping it (WNOWAIT): a zombie, whose pid os.kill(pid, 0) still finds.
        while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            assert time.monotonic() < deadline, "the SIGKILLed child did not exit within 30 s"
            time.sleep(0.02)
        assert lock_module._alive(child.pid)  # what the pid check alone would have refused
        with caplog.at_level(logging.INFO, logger="mixprec"):
            with RunLock(tmp_path) as lock:
                assert lock.held and owner(tmp_path)["pid"] == os.getpid()
        assert any(f"left by pid {child.pid}" in r.getMessage() for r in caplog.records)
        assert not (tmp_path / LOCK_NAME).exists()
    finally:
        stop(child)


def test_a_lock_file_naming_a_live_pid_that_does_not_hold_the_lock_is_taken_over(tmp_path):
    other = os.getppid()  # alive, on this host, and not a run: a reused pid
    assert lock_module._alive(other)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": other, "host": socket.gethostname(), "since": 0}))
    with RunLock(tmp_path):
        assert owner(tmp_path)["pid"] == os.getpid() and owner(tmp_path)["host"] == socket.gethostname()


def test_a_stale_lock_file_does_not_stop_the_trainer(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with caplog.at_level(logging.INFO, logger="mixprec"):
        assert trainer(tmp_path).train().global_step == 2
    assert any("no longer holds it" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def test_the_lock_is_re_entrant_in_one_process_and_released_by_the_last_holder(tmp_path):
    def held_by_someone() -> bool:  # a second open file description conflicts even in this process
        fd = os.open(folder / LOCK_NAME, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    folder = tmp_path / "run"
    (tmp_path / "alias").symlink_to(folder, target_is_directory=True)
    outer = RunLock(folder)
    assert not outer.held
    with outer:
        with RunLock(tmp_path / "alias") as inner:  # the same folder, through a symlink
            assert inner.held and owner(folder)["pid"] == os.getpid()
        assert not inner.held and outer.held
        assert (folder / LOCK_NAME).exists() and held_by_someone()
        with pytest.raises(RuntimeError, match="already held"):
            outer.__enter__()
    assert not outer.held and not (folder / LOCK_NAME).exists()
    with RunLock(folder):  # and it can be taken again
        pass


def test_a_forked_child_is_not_a_holder_and_does_not_release_the_parents_lock(tmp_path):
    with RunLock(tmp_path):
        pid = os.fork()
        if pid == 0:  # the child (a dataloader worker, say): refused, as any other process
            try:
                RunLock(tmp_path).__enter__()
                code = 1
            except RuntimeError as e:
                code = 0 if f"pid {os.getppid()}" in str(e) else 2
            except BaseException:
                code = 3
            os._exit(code)
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.monotonic() < deadline, "the forked child did not finish within 30 s"
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(done[1]) == 0
        fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # still held, after the child closed its copy
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS])
def test_without_file_locks_the_pid_in_the_file_decides_with_one_warning(tmp_path, monkeypatch, caplog, code):
    def no_locks(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(lock_module, "_warned_no_locks", False)
    host = socket.gethostname()
    with caplog.at_level(logging.INFO, logger="mixprec"):
        with RunLock(tmp_path / "a"):
            assert owner(tmp_path / "a")["pid"] == os.getpid()
            with RunLock(tmp_path / "a"):  # re-entrant here too
                pass
            assert (tmp_path / "a" / LOCK_NAME).exists()
        assert not (tmp_path / "a" / LOCK_NAME).exists()
        # A live pid on this host refuses (the fallback cannot tell a reused pid from the run).
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": host}))
        with pytest.raises(RuntimeError, match=f"in use by a live run \\(pid {os.getppid()} on {host}"):
            RunLock(tmp_path / "b").__enter__()
        # A dead pid is taken over, with a warning.
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(timeout=30)
        (tmp_path / "b" / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": host}))
        with RunLock(tmp_path / "b"):
            assert owner(tmp_path / "b")["pid"] == os.getpid()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("has no file locks" in w and "another host" in w for w in warnings) == 1  # once per process
    assert any("no longer running" in w for w in warnings)


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_first_step():
    with pytest.raises(RuntimeError, match="cannot be written.*writable output_dir"):
        trainer("/sys/mixprec-test-out").train()

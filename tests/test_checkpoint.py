"""save_state / load_state: atomic, verified, never runs code, and resumes bit for bit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from mixprec import Accelerator, CheckpointError
from mixprec.checkpoint.folder import (
    CheckpointReader,
    checkpoint_problem,
    is_complete_checkpoint,
    numbered_checkpoints,
    raise_first_problem,
    read_manifest,
    rotate_checkpoints,
    verify_checkpoint,
    write_checkpoint,
)

from toys import SCRIPTS, Preloaded, TinyLM

SCRIPT = SCRIPTS / "resume_accel.py"
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


#: The script's runs start forked from a process that has imported torch (each still a process of its
#: own, killed as one); not Accelerate, which the script never imports.
PRELOADED = Preloaded("torch", "safetensors.torch")


def run_script(out, *args, expect_kill=False):
    proc = PRELOADED.run(SCRIPT, str(out), *args, logs=out.parent, timeout=300)
    if expect_kill:
        assert proc.returncode == -9, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("precision,resume", [("fp32", "skip_first_batches"), ("fp16", "skip_first_batches"),
                                              ("fp16", "stateful")])
def test_save_kill_load_continue_equals_an_uninterrupted_run_bit_for_bit(tmp_path, precision, resume):
    """Accelerate's default (the loop skips the batches it saw) and the stateful dataloader
    (load_state resumes at the next batch, the loop skips nothing) both resume bit for bit."""
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir()
    part.mkdir()
    flags = ["--precision", precision] + (["--stateful"] if resume == "stateful" else [])
    run_script(full, *flags)
    run_script(part, *flags, "--save-at", "13", "--kill", expect_kill=True)
    assert not (part / "final.safetensors").exists()  # it really died
    run_script(part, *flags, "--resume", str(part / "ckpt"))
    a = safetensors.torch.load_file(str(full / "final.safetensors"))
    b = safetensors.torch.load_file(str(part / "final.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((full / "final.json").read_text()) == json.loads((part / "final.json").read_text())


@pytest.fixture
def saved(tmp_path):
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randint(0, 32, (4, 6)), labels=torch.randint(0, 32, (4, 6))).loss)
    opt.step()
    path = acc.save_state(tmp_path / "ckpt")
    return acc, path


def test_checkpoint_has_manifest_safetensors_weights_and_every_state(saved):
    _, path = saved
    files = verify_checkpoint(path)
    assert {"model_0.safetensors", "optimizer_0.bin", "scaler.bin", "random_states_0.bin",
            "accelerator.bin"} <= set(files)
    assert all(len(v["sha256"]) == 64 for v in files.values())
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_a_checkpoint_with_one_byte_changed_is_refused_naming_the_file(saved):
    acc, path = saved
    f = path / "optimizer_0.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer_0.bin.*altered"):
        acc.load_state(path)


def test_a_truncated_checkpoint_is_refused(saved):
    acc, path = saved
    f = path / "model_0.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model_0.safetensors.*truncated"):
        acc.load_state(path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_pickle_that_would_run_code_is_refused_without_running_it(saved, tmp_path, monkeypatch):
    acc, path = saved
    monkeypatch.chdir(tmp_path)
    f = path / "optimizer_0.bin"
    torch.save({"state": {}, "param_groups": [], "evil": _Evil()}, f)
    # The attacker also rewrites the manifest, so only weights_only stands in the way.
    manifest = json.loads((path / "manifest.json").read_text())
    import hashlib

    manifest["files"]["optimizer_0.bin"] = {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refusing to load .*optimizer_0.bin"):
        acc.load_state(path)
    assert not (tmp_path / "PWNED").exists()


def test_a_folder_without_manifest_is_not_a_checkpoint(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model_0.safetensors").write_bytes(b"x")
    assert not is_complete_checkpoint(tmp_path / "half")
    with pytest.raises(CheckpointError, match="no manifest.json"):
        verify_checkpoint(tmp_path / "half")


def test_a_crash_during_save_leaves_the_previous_checkpoint_intact(tmp_path):
    write_checkpoint(tmp_path / "ckpt", {"a.bin": lambda p: torch.save({"v": torch.ones(2)}, p)})

    def crash(p):
        p.write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "ckpt", {"a.bin": lambda p: torch.save({"v": torch.zeros(2)}, p), "b.bin": crash})
    verify_checkpoint(tmp_path / "ckpt")
    assert torch.equal(torch.load(tmp_path / "ckpt" / "a.bin", weights_only=True)["v"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_save_model_writes_loadable_safetensors(tmp_path):
    acc = Accelerator(cpu=True)
    model = acc.prepare(TinyLM())
    acc.save_model(model, tmp_path / "m")
    twin = TinyLM()
    safetensors.torch.load_model(twin, str(tmp_path / "m" / "model.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))



def test_a_checkpoint_write_that_fails_for_real_leaves_the_previous_one_and_says_what_it_needs(tmp_path):
    """A file size limit (RLIMIT_FSIZE) makes the second save fail with EFBIG, as a full disk would."""
    script = SCRIPTS / "full_disk.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["errno"] == 27 and "file size limit" in seen["message"]
    assert str(tmp_path / "ckpt") in seen["message"] and "bytes" in seen["message"]
    assert seen["previous_intact"] and seen["left_in_out"] == ["ckpt"]  # no staging debris
    # The Trainer with on_save_error="warn": both saves failed, training finished, nothing half-written.
    assert seen["trainer_steps"] == 4 and seen["left_in_run"] == []
    # Rotation: checkpoint-4 failed after checkpoint-2 was complete; save_total_limit=1 kept checkpoint-2.
    assert seen["left_after_rotation"] == ["checkpoint-2"] and seen["kept_complete"]
    assert proc.stderr.count("was not written: a file size limit was reached") == 3


def _write(path, files):
    """A checkpoint of ``files`` (name -> bytes, names may hold folders), written atomically."""
    def writer(content):
        def write(p):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content)
        return write
    return write_checkpoint(path, {name: writer(content) for name, content in files.items()}, meta={"step": 3})


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
def test_a_commit_makes_every_file_the_manifest_and_each_folder_durable_before_the_rename(tmp_path, monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):  # what was made durable, and how big it was then
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    open_before = len(os.listdir("/proc/self/fd"))
    final = _write(tmp_path / "ckpt", {"a.bin": b"abc", "sub/b.bin": b"defgh"})
    assert len(os.listdir("/proc/self/fd")) == open_before  # every descriptor it opened is closed
    rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final))
    tmp = events[rename][1]
    synced = {path: size for kind, path, size in events[:rename] if kind == "fsync"}
    for rel in ("a.bin", "sub/b.bin", "manifest.json"):  # each as big as it ends up: flushed first
        assert synced.get(f"{tmp}/{rel}") == (final / rel).stat().st_size, rel
    assert {tmp, f"{tmp}/sub"} <= set(synced)  # the folders: their entries are durable
    assert ("fsync", str(tmp_path)) in [e[:2] for e in events[rename + 1:]]  # and the rename itself


def test_a_checkpoint_replaced_by_a_new_one_leaves_no_old_copy(tmp_path):
    _write(tmp_path / "ckpt", {"a.bin": b"old"})
    _write(tmp_path / "ckpt", {"a.bin": b"new"})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (tmp_path / "ckpt" / "a.bin").read_bytes() == b"new"


def test_a_checkpoint_is_written_into_folders_that_do_not_exist_yet_and_keeps_its_meta(tmp_path):
    final = _write(tmp_path / "runs" / "a" / "ckpt", {"a.bin": b"x", "empty.bin": b""})
    assert read_manifest(final)["meta"] == {"step": 3}
    assert verify_checkpoint(final)["empty.bin"]["size"] == 0  # an empty file is a file


def test_checkpoint_problem_names_a_missing_or_truncated_file_without_hashing(tmp_path):
    final = _write(tmp_path / "ckpt", {"a.bin": b"abc", "b.bin": b"defg"})
    assert checkpoint_problem(final) is None
    (final / "a.bin").write_bytes(b"xyz")  # same size: only a hash would tell
    assert checkpoint_problem(final) is None
    (final / "b.bin").write_bytes(b"de")
    assert "b.bin is 2 bytes, the manifest says 4: truncated" in checkpoint_problem(final)
    (final / "b.bin").unlink()
    assert "b.bin is missing" in checkpoint_problem(final)
    assert checkpoint_problem(final, skip=["b.bin"]) is None


def test_read_bytes_returns_a_file_only_once_its_sha256_is_the_manifests(tmp_path):
    final = _write(tmp_path / "ckpt", {"a.json": b'{"x": 1}'})
    assert CheckpointReader(final).read_bytes("a.json") == b'{"x": 1}'
    (final / "a.json").write_bytes(b'{"x": 2}')
    with pytest.raises(CheckpointError, match="sha256 of .*a.json is not the one in the manifest"):
        CheckpointReader(final).read_bytes("a.json")


def test_the_first_problem_of_several_processes_names_its_process():
    raise_first_problem([None, None])
    with pytest.raises(CheckpointError, match=r"^process 1 of 2: b\.bin is missing$"):
        raise_first_problem([None, "b.bin is missing"])
    with pytest.raises(CheckpointError, match=r"^a\.bin is missing$"):
        raise_first_problem(["a.bin is missing"])


def test_numbered_checkpoints_are_the_complete_ones_in_step_order_and_rotation_clears_crashed_saves(tmp_path,
                                                                                                   caplog):
    for n in (10, 9, 100):
        _write(tmp_path / f"checkpoint-{n}", {"a.bin": b"x"})
    (tmp_path / "checkpoint-50").mkdir()  # no manifest: half-written, or not ours
    (tmp_path / ".checkpoint-101.tmp-0123abcd").mkdir()  # a save that crashed
    assert [p.name for p in numbered_checkpoints(tmp_path, "checkpoint-")] == [
        "checkpoint-9", "checkpoint-10", "checkpoint-100"]
    assert len(numbered_checkpoints(tmp_path, "checkpoint-", complete=False)) == 4
    rotate_checkpoints(tmp_path, "checkpoint-", None)
    assert not (tmp_path / ".checkpoint-101.tmp-0123abcd").exists() and (tmp_path / "checkpoint-50").is_dir()
    with caplog.at_level(logging.INFO, logger="mixprec"):
        rotate_checkpoints(tmp_path, "checkpoint-", 2)  # the oldest goes, and the log says which
    assert [p.name for p in numbered_checkpoints(tmp_path, "checkpoint-")] == ["checkpoint-10", "checkpoint-100"]
    said = [r.getMessage() for r in caplog.records if "deleting" in r.getMessage()]
    assert len(said) == 1 and "checkpoint-9 (a limit of 2 checkpoints)" in said[0], said


def test_a_deletion_killed_midway_leaves_no_half_deleted_checkpoint_and_the_next_rotation_clears_it(tmp_path,
                                                                                                    monkeypatch):
    for n in (1, 2, 3):
        _write(tmp_path / f"checkpoint-{n}", {"a.bin": b"x", "b.bin": b"y"})
    import mixprec.checkpoint.folder as folder

    def killed(path, ignore_errors=False):  # the process dies after removing one file of the folder
        next(Path(path).glob("*.bin")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(folder.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        rotate_checkpoints(tmp_path, "checkpoint-", 2)
    monkeypatch.undo()
    # checkpoint-1 is whole or gone: gone from its name, its remains hidden under .checkpoint-1.old-<id>
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for name in ("checkpoint-2", "checkpoint-3"):
        verify_checkpoint(tmp_path / name)
    (left,) = tmp_path.glob(".checkpoint-1.old-*")
    rotate_checkpoints(tmp_path, "checkpoint-", 2)
    assert not left.exists()



def test_a_file_another_writer_wrote_is_hashed_in_pieces_and_a_changed_piece_fails_naming_the_file(tmp_path,
                                                                                                     monkeypatch):
    import hashlib

    import mixprec.checkpoint.integrity as integrity
    from mixprec.checkpoint.folder import commit_checkpoint

    monkeypatch.setattr(integrity, "PIECE", 1 << 16)  # 64 KiB pieces, so that a small file has several
    stage = tmp_path / "stage"
    stage.mkdir()
    big = os.urandom(5 * (1 << 16) + 123)  # five whole pieces and a short last one
    (stage / "optimizer.pt").write_bytes(big)
    (stage / "trainer_state.json").write_text("{}")
    final = commit_checkpoint(stage, tmp_path / "checkpoint-2", written=integrity.sync_and_hash(stage))
    rows = read_manifest(final)["files"]
    assert rows["trainer_state.json"] == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    assert rows["optimizer.pt"] == {"size": len(big), "piece": 1 << 16, "sha256_pieces": [
        hashlib.sha256(big[i:i + (1 << 16)]).hexdigest() for i in range(0, len(big), 1 << 16)]}
    assert len(rows["optimizer.pt"]["sha256_pieces"]) == 6
    verify_checkpoint(final)

    damaged = bytearray(big)
    damaged[3 * (1 << 16) + 7] ^= 1  # one bit of the fourth piece
    (final / "optimizer.pt").write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match=r"the sha256 of .*optimizer\.pt is not the one in the manifest"):
        verify_checkpoint(final)

    manifest = json.loads((final / "manifest.json").read_text())
    pieces = manifest["files"]["optimizer.pt"]["sha256_pieces"]
    for bad in (pieces[:-1], [*pieces[:-1], "not a digest"], [*pieces[:-1], 7]):  # cannot cover the file; not hex
        manifest["files"]["optimizer.pt"]["sha256_pieces"] = bad
        (final / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(CheckpointError, match=r"the row of optimizer\.pt has no valid 'piece' and 'sha256_pieces'"):
            read_manifest(final)


def test_a_range_of_a_file_hashes_as_its_bytes_and_a_range_past_the_end_as_what_is_there(tmp_path):
    import hashlib

    from mixprec.checkpoint.integrity import sha256_file

    data = os.urandom(3 * 4096 + 1)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "one").write_bytes(b"x")
    assert sha256_file(tmp_path / "one") == hashlib.sha256(b"x").hexdigest()
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert sha256_file(tmp_path / "f", 4096, 4096) == hashlib.sha256(data[4096:8192]).hexdigest()
    assert sha256_file(tmp_path / "f", 3 * 4096, 4096) == hashlib.sha256(data[3 * 4096:]).hexdigest()  # 1 byte


def test_sync_and_hash_rows_a_file_up_to_a_piece_whole_and_a_larger_one_in_pieces_and_fails_with_its_fsync(
        tmp_path, monkeypatch):
    import errno
    import hashlib

    import mixprec.checkpoint.integrity as integrity

    with open(tmp_path / "big.bin", "wb") as fh:  # sparse: no disk used, zeros read back
        fh.truncate(integrity.PIECE + 1)
    with open(tmp_path / "even.bin", "wb") as fh:
        fh.truncate(integrity.PIECE)
    (tmp_path / "small.json").write_text("{}")
    rows = integrity.sync_and_hash(tmp_path)
    assert rows["small.json"] == {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    assert rows["even.bin"] == {"size": integrity.PIECE, "sha256": hashlib.sha256(bytes(integrity.PIECE)).hexdigest()}
    assert rows["big.bin"] == {"size": integrity.PIECE + 1, "piece": integrity.PIECE, "sha256_pieces": [
        hashlib.sha256(bytes(integrity.PIECE)).hexdigest(), hashlib.sha256(b"\0").hexdigest()]}

    synced = []

    def failing_fsync(fd):
        synced.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(integrity.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):  # a file that cannot be made durable is no row
        integrity.sync_and_hash(tmp_path)
    assert synced

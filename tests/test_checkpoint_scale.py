"""Checkpoints at scale (issue 28): each process hashes and fsyncs what it writes while writing it,
verifies only what it reads, and the processes agree on the verdict; the manifest is validated as a
whole; a damaged checkpoint is never skipped in silence; the Accelerator clears leftovers of its
interrupted saves."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from mixprec import Accelerator, ProjectConfiguration, Trainer, TrainerCallback, TrainingArguments
from mixprec.checkpoint import CheckpointError
from mixprec.checkpoint.folder import MANIFEST, read_manifest, verify_checkpoint
from mixprec.checkpoint.integrity import HashingFile, WrittenFiles, sha256_file, write_safetensors

from toys import SCRIPTS, Classifier, Opens, blobs, free_port, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


def prepared(dim: int = 256, project: ProjectConfiguration | None = None):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=project)
    model = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    acc.backward(model(torch.randn(4, dim)).pow(2).mean())
    opt.step()
    opt.zero_grad()
    return acc, model, opt


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# -- writing: hashed while written, never read back ------------------------------------------------
def test_save_state_reads_back_nothing_it_wrote_and_its_manifest_holds_each_files_true_sha256(tmp_path):
    acc, model, opt = prepared()
    acc.save_state(tmp_path / "warm")  # imports and first-call set-up out of the way
    with Opens(tmp_path / "ckpt") as opened:
        acc.save_state(tmp_path / "ckpt")
    assert opened.seen == []  # no file of the checkpoint was opened for reading while saving it
    files = read_manifest(tmp_path / "ckpt")["files"]
    assert set(files) >= {"model_0.safetensors", "optimizer_0.bin", "random_states_0.bin", "accelerator.bin"}
    for rel, row in files.items():  # the hashes computed while writing are the files' own
        assert row == {"size": (tmp_path / "ckpt" / rel).stat().st_size, "sha256": sha256_file(tmp_path / "ckpt" / rel)}


def test_a_hashing_file_under_torch_save_gives_the_files_size_and_sha256(tmp_path):
    written = WrittenFiles(tmp_path)
    state = {"w": torch.randn(600, 1000), "small": torch.arange(3), "note": "x"}  # a >1 MiB write and small ones
    written.torch_save(state, "state.bin")
    row = written.entries()["state.bin"]
    assert row == {"size": (tmp_path / "state.bin").stat().st_size, "sha256": sha256_file(tmp_path / "state.bin")}
    back = torch.load(tmp_path / "state.bin", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and back["note"] == "x"


def test_streamed_safetensors_are_safetensors_own_bytes_and_load_back_in_every_dtype(tmp_path):
    one_dtype = {"b": torch.randn(3, 5), "a": torch.randn(7), "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 4)}
    for meta in (None, {"format": "pt"}):
        buf = io.BytesIO()
        write_safetensors(one_dtype, buf, metadata=meta)
        assert buf.getvalue() == safetensors.torch.save(one_dtype, metadata=meta)
    mixed = {"f64": torch.randn(2, dtype=torch.float64), "bf16": torch.randn(3, 3).bfloat16(),
             "f16": torch.randn(5).half(), "i64": torch.arange(4), "bool": torch.tensor([True, False, True]),
             "u8": torch.arange(9, dtype=torch.uint8), "f8": torch.randn(4).to(torch.float8_e4m3fn),
             "view": torch.randn(4, 6)[:, 1:3],  # not contiguous
             "u16": torch.arange(5).to(torch.uint16)}  # a dtype streamed by safetensors itself
    for tensors in (mixed, {k: v for k, v in mixed.items() if k != "u16"}):
        path = tmp_path / "m.safetensors"
        with HashingFile(path) as fh:
            write_safetensors(tensors, fh, metadata={"format": "pt", "note": "mixprec"})
        back = safetensors.torch.load_file(str(path))
        assert set(back) == set(tensors)
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.contiguous().view(torch.uint8))
        with safetensors.safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt", "note": "mixprec"}


def test_streamed_safetensors_go_tensor_by_tensor_each_aligned_to_its_element_size(tmp_path):
    tensors = {"bool": torch.tensor([True, False, True]), "u8": torch.arange(9, dtype=torch.uint8),
               "i8": torch.arange(3, dtype=torch.int8), "i16": torch.arange(3, dtype=torch.int16),
               "i32": torch.arange(5, dtype=torch.int32), "f8e5m2": torch.randn(3).to(torch.float8_e5m2),
               "c64": torch.randn(3, dtype=torch.complex64), "f64": torch.randn(3, dtype=torch.float64),
               "big": torch.randn(64, 64)}
    writes = []

    class Recorder(io.BytesIO):
        def write(self, data):
            writes.append(memoryview(data).nbytes)
            return super().write(data)

    buf = Recorder()
    write_safetensors(tensors, buf)
    header_len = int.from_bytes(buf.getvalue()[:8], "little")
    # The header, then one tensor a write: never the whole file in memory.
    assert writes[0] == 8 + header_len and sorted(writes[1:]) == sorted(t.nbytes for t in tensors.values())
    header = json.loads(buf.getvalue()[8:8 + header_len])
    for name, t in tensors.items():  # each starts at a multiple of its element size (zero-copy loads)
        assert header[name]["data_offsets"][0] % t.element_size() == 0, name
    back = safetensors.torch.load(buf.getvalue())
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name


class _Syncs:
    """os.fsync and os.close, spied on: which files were made durable, and how big they were then."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.synced, self.real_fsync, self.fail = {}, os.fsync, fail
        monkeypatch.setattr(os, "fsync", self.fsync)

    def fsync(self, fd):
        if self.fail:
            raise OSError(5, "Input/output error")
        self.synced[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_size
        self.real_fsync(fd)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
def test_a_hashing_file_is_durable_when_closed_and_closes_what_it_opened(tmp_path, monkeypatch):
    syncs, before, rows = _Syncs(monkeypatch), _open_fds(), []
    with HashingFile(tmp_path / "a.bin", lambda size, digest: rows.append((size, digest))) as fh:
        assert fh.writable() and not fh.seekable()  # torch.save writes it as a stream
        fh.write(b"abc")
        fh.write(bytearray(3 << 20))  # a large write: hashed while it is written
        fh.write(b"xyz")  # and a small last one: on disk when fsynced (nothing held in a buffer)
    fh.close()  # a second close does nothing
    assert syncs.synced == {str(tmp_path / "a.bin"): 6 + (3 << 20)} and _open_fds() == before
    assert rows == [(6 + (3 << 20), sha256_file(tmp_path / "a.bin"))]
    with HashingFile(tmp_path / "empty.bin", lambda size, digest: rows.append((size, digest))):
        pass
    assert rows[-1] == (0, sha256_file(tmp_path / "empty.bin"))


def test_a_hashing_file_takes_any_buffer_as_its_bytes(tmp_path):
    import numpy as np

    data = [np.arange(12, dtype=np.uint8).reshape(3, 4), np.arange(5, dtype=np.float32),
            np.arange(6, dtype=np.float64).reshape(2, 3), b"tail"]
    with HashingFile(tmp_path / "a.bin", sync=False) as fh:
        assert [fh.write(d) for d in data] == [12, 20, 48, 4]
    assert (tmp_path / "a.bin").read_bytes() == b"".join(bytes(memoryview(d).cast("B")) for d in data)


def test_a_large_write_returns_only_once_its_bytes_are_hashed_so_the_caller_may_reuse_the_buffer(tmp_path):
    import hashlib
    import threading

    import mixprec.checkpoint.integrity as integrity

    release = threading.Event()
    integrity._HASHER.submit(release.wait)  # the hashing thread is busy: the write must wait for it
    threading.Timer(0.3, release.set).start()
    buf, rows = bytearray(b"a" * (2 << 20)), []
    with HashingFile(tmp_path / "a.bin", lambda size, digest: rows.append(digest), sync=False) as fh:
        fh.write(buf)
        buf[:] = b"b" * len(buf)  # the caller's buffer, reused once write() returned
    assert rows == [hashlib.sha256(b"a" * (2 << 20)).hexdigest()] == [sha256_file(tmp_path / "a.bin")]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
def test_written_files_are_durable_once_their_rows_are_returned_and_a_failed_fsync_is_raised(tmp_path, monkeypatch):
    syncs, before = _Syncs(monkeypatch), _open_fds()
    written = WrittenFiles(tmp_path)
    written.torch_save({"w": torch.ones(3)}, "a.bin")
    written.write_bytes("b.json", b"{}")
    rows = written.entries()
    assert syncs.synced == {str(tmp_path / n): (tmp_path / n).stat().st_size for n in ("a.bin", "b.json")}
    assert set(rows) == {"a.bin", "b.json"} and _open_fds() == before
    syncs.fail = True
    written.write_bytes("c.json", b"{}")
    with pytest.raises(OSError, match="Input/output error"):
        written.entries()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/self/fd (Linux)")
def test_a_file_whose_writer_raised_is_closed_and_not_recorded(tmp_path):
    written, before = WrittenFiles(tmp_path), _open_fds()
    with pytest.raises(RuntimeError, match="writer failed"):
        with written.open(tmp_path / "a.bin") as fh:
            fh.write(b"half")
            raise RuntimeError("writer failed")
    fh.close()  # (a later close does not record it either)
    assert written.entries() == {} and _open_fds() == before


def test_a_renamed_written_file_keeps_its_row_under_its_new_name(tmp_path):
    written = WrittenFiles(tmp_path)
    written.write_bytes(".metadata.tmp", b"meta")
    written.rename(tmp_path / ".metadata.tmp", tmp_path / ".metadata")
    written.rename(tmp_path / "never-written", tmp_path / "other")
    assert set(written.entries()) == {".metadata"} and written.entries()[".metadata"]["size"] == 4


def test_tied_weights_are_written_once_and_tied_again_on_load(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = acc.prepare(Tied())
    acc.save_state(tmp_path / "ckpt")
    with safetensors.safe_open(str(tmp_path / "ckpt" / "model_0.safetensors"), "pt") as f:
        assert list(f.keys()) == ["emb.weight"]
    saved = model.emb.weight.detach().clone()
    with torch.no_grad():
        model.emb.weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(model.emb.weight, saved) and model.head.weight is model.emb.weight


def test_a_checkpoint_in_the_previous_layout_still_loads(tmp_path):
    """Before, the main process wrote the weights with ``safetensors.torch.save_model`` and hashed
    every file after the fact: the same manifest format, read the same way."""
    acc, model, opt = prepared(dim=16)
    acc.save_state(tmp_path / "new")
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "new", old)
    (old / MANIFEST).unlink()
    safetensors.torch.save_model(model, str(old / "model_0.safetensors"))
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(old.iterdir())}
    (old / MANIFEST).write_text(json.dumps({"format": "mixprec-checkpoint-1", "files": files, "meta": {}}))
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(old)
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))


# -- reading: each file verified as it is read; nothing restored from a damaged checkpoint --------
@pytest.mark.parametrize("victim", ["optimizer_0.bin", "model_0.safetensors", "random_states_0.bin"])
def test_a_changed_byte_fails_the_load_naming_the_file_and_restores_nothing(tmp_path, victim):
    acc, model, opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    acc.step = 0
    flip_a_byte(tmp_path / "ckpt" / victim)
    before = [p.detach().clone() for p in model.parameters()]
    moments = [s["exp_avg"].clone() for s in opt.optimizer.state.values()]
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=f"sha256 of .*{victim}.* altered or damaged.*load an earlier"):
        acc.load_state(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, opt.optimizer.state.values()))
    assert torch.equal(rng, torch.get_rng_state()) and acc.step == 0


def test_a_load_opens_only_the_files_this_process_needs(tmp_path):
    acc, model, opt = prepared()
    acc.save_state(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "random_states_1.bin").write_bytes(b"another process's")  # not read by process 0
    with Opens(tmp_path / "ckpt") as opened:
        acc.load_state(tmp_path / "ckpt")
    assert sorted(set(opened.seen)) == sorted(["manifest.json", "model_0.safetensors", "optimizer_0.bin",
                                               "random_states_0.bin", "accelerator.bin"])
    assert max(opened.seen.count(f) for f in opened.seen) <= 2  # hashed, and parsed by torch.load: side by side


# -- the manifest, validated as a whole ------------------------------------------------------------
def _damage(kind: str, manifest: dict) -> str | dict | list:
    files = manifest["files"]
    first = sorted(files)[0]
    if kind == "not json":
        return json.dumps(manifest)[:-1] + "#"
    if kind == "a list":
        return [manifest]
    if kind == "no files":
        return {k: v for k, v in manifest.items() if k != "files"}
    if kind == "format":
        return {**manifest, "format": "mixprec-checkpoint-9"}
    if kind == "size renamed":
        files[first] = {"bytes": files[first]["size"], "sha256": files[first]["sha256"]}
    elif kind == "size a string":
        files[first]["size"] = str(files[first]["size"])
    elif kind == "sha256 short":
        files[first]["sha256"] = files[first]["sha256"][:10]
    elif kind == "escapes the folder":
        files["../outside.bin"] = files.pop(first)
    elif kind == "meta a list":
        manifest["meta"] = []
    return manifest


@pytest.mark.parametrize("kind", ["not json", "a list", "no files", "format", "size renamed", "size a string",
                                  "sha256 short", "escapes the folder", "meta a list"])
def test_every_way_a_manifest_can_be_wrong_is_a_checkpoint_error_naming_it_and_the_fix(tmp_path, kind):
    acc, model, opt = prepared(dim=8)
    acc.save_state(tmp_path / "ckpt")
    where = tmp_path / "ckpt" / MANIFEST
    damaged = _damage(kind, json.loads(where.read_text()))
    where.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    for attempt in (lambda: acc.load_state(tmp_path / "ckpt"), lambda: verify_checkpoint(tmp_path / "ckpt")):
        with pytest.raises(CheckpointError) as e:
            attempt()
        assert str(where) in str(e.value) and "load an earlier checkpoint" in str(e.value), str(e.value)
        assert not isinstance(e.value, KeyError)


# -- the Trainer: a damaged newest checkpoint never disappears without a word ----------------------
def _trainer(out: Path, steps: int = 6) -> Trainer:
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=2, per_device_train_batch_size=8,
                             disable_tqdm=True, report_to="none", use_cpu=True, seed=0)
    torch.manual_seed(0)
    return Trainer(model=Classifier(), args=args, train_dataset=blobs(64))


@pytest.fixture
def three_checkpoints(tmp_path):
    out = tmp_path / "run"
    _trainer(out).train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    return out


def test_true_raises_on_a_damaged_newest_checkpoint_naming_the_newest_that_verifies(three_checkpoints, caplog):
    out = three_checkpoints
    manifest = out / "checkpoint-6" / MANIFEST
    data = bytearray(manifest.read_bytes())
    data[0] = ord("#")  # one byte: no longer JSON
    manifest.write_bytes(bytes(data))
    flip_a_byte(out / "checkpoint-4" / "optimizer_0.bin")  # the one before is damaged too
    (out / ".checkpoint-8.tmp-0123abcd").mkdir()  # an interrupted save's staging folder: not a checkpoint
    with pytest.raises(CheckpointError) as e:
        _trainer(out, steps=8).train(resume_from_checkpoint=True)
    msg = str(e.value)
    assert "checkpoint-6" in msg and "not valid JSON" in msg
    assert f"the newest checkpoint that verifies is {out / 'checkpoint-2'}" in msg
    assert "resume_from_checkpoint=" in msg and "'auto'" in msg
    assert (out / "checkpoint-6").is_dir()  # nothing overwritten


def test_a_hash_mismatch_found_while_loading_the_newest_also_names_the_fix(three_checkpoints):
    out = three_checkpoints
    flip_a_byte(out / "checkpoint-6" / "model_0.safetensors")
    with pytest.raises(CheckpointError, match=r"checkpoint-6, is damaged: the sha256 of .*model_0.safetensors.*"
                                              r"the newest checkpoint that verifies is .*checkpoint-4"):
        _trainer(out, steps=8).train(resume_from_checkpoint=True)


def test_auto_takes_the_newest_that_verifies_and_warns_about_each_it_skipped(three_checkpoints, caplog):
    out = three_checkpoints
    (out / "checkpoint-6" / MANIFEST).write_text("{")
    flip_a_byte(out / "checkpoint-4" / "model_0.safetensors")
    (out / ".checkpoint-8.tmp-0123abcd").mkdir()
    trainer = _trainer(out, steps=6)
    began = []

    class Began(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            began.append(state.global_step)

    trainer.add_callback(Began())
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer.train(resume_from_checkpoint="auto")
    skipped = [r.getMessage() for r in caplog.records if "skipping the checkpoint" in r.getMessage()]
    assert len(skipped) == 2
    assert "checkpoint-6" in skipped[0] and "not valid JSON" in skipped[0]
    assert "checkpoint-4" in skipped[1] and "sha256" in skipped[1]
    assert not any("tmp-0123abcd" in r.getMessage() for r in caplog.records)
    assert began == [2] and trainer.state.global_step == 6  # resumed from checkpoint-2
    assert verify_checkpoint(out / "checkpoint-6")  # saved again, whole


def test_a_named_damaged_checkpoint_is_never_swapped_for_another(three_checkpoints):
    out = three_checkpoints
    (out / "checkpoint-4" / "optimizer_0.bin").write_bytes(b"short")
    with pytest.raises(CheckpointError, match=r"checkpoint-4/optimizer(_0.bin|.pt) is 5 bytes, the manifest says"):
        _trainer(out, steps=8).train(resume_from_checkpoint=str(out / "checkpoint-4"))


def test_a_damaged_trainer_state_fails_the_resume(three_checkpoints):
    out = three_checkpoints
    state = out / "checkpoint-6" / "trainer_state.json"
    text = state.read_text()
    state.write_text(text.replace('"global_step": 6', '"global_step": 5'))
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        _trainer(out, steps=8).train(resume_from_checkpoint=str(out / "checkpoint-6"))


# -- the Accelerator's leftovers --------------------------------------------------------------------
def test_the_accelerator_clears_its_interrupted_saves_in_its_locked_checkpoints_folder(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path / "proj"), automatic_checkpoint_naming=True)
    acc, model, opt = prepared(dim=8, project=project)
    ckpts = tmp_path / "proj" / "checkpoints"
    ckpts.mkdir(parents=True)
    leftovers = [ckpts / ".checkpoint_0.tmp-0123abcd", ckpts / ".checkpoint_3.old-89abcdef"]  # a SIGKILL mid-save
    for d in leftovers:
        d.mkdir()
        (d / "random_states_0.bin").write_bytes(b"half")
    acc.save_state()
    assert not any(d.exists() for d in leftovers)
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint_0"]  # the lock is held during the save only
    assert sorted(p.name for p in (tmp_path / "proj").iterdir()) == ["checkpoints"]


def test_a_checkpoints_folder_locked_by_another_live_run_is_refused_and_its_saves_kept(tmp_path):
    ckpts = tmp_path / "proj" / "checkpoints"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from mixprec.checkpoint import RunLock\n"
         "with RunLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)", str(ckpts)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    try:
        assert holder.stdout.readline().strip() == "held"
        live = ckpts / ".checkpoint_0.tmp-0123abcd"  # the other run's save in progress
        live.mkdir(parents=True)
        acc, model, opt = prepared(dim=8, project=ProjectConfiguration(project_dir=str(tmp_path / "proj"),
                                                                       automatic_checkpoint_naming=True))
        with pytest.raises(RuntimeError, match=rf"the checkpoints folder {ckpts} is in use by a live run "
                                               rf"\(pid {holder.pid}"):
            acc.save_state()
        assert live.is_dir()
        acc.save_state(tmp_path / "proj" / "explicit")  # a named folder is saved; the other run's staging kept
        assert live.is_dir() and (tmp_path / "proj" / "explicit" / MANIFEST).is_file()
    finally:
        holder.kill()
        holder.wait(timeout=30)


# -- two processes: a damaged shard of rank 1 ----------------------------------------------------------
def _check_ranks(out: Path, layout: str) -> None:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    damaged = ranks[0]["damaged"]
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1, errors  # every rank raises the same error
    (error,) = errors
    assert error is not None and error.startswith("process 1 of 2: the sha256 of") and damaged in error
    assert all(r["unchanged"] for r in ranks)  # nothing restored from the damaged checkpoint
    assert all(r["opened_saving"] == [] for r in ranks)  # no rank read back what it wrote
    for r in ranks:  # no rank opened another rank's own files
        other = 1 - r["rank"]
        assert not [f for f in r["opened_loading"] if f"__{other}_0" in f or f"random_states_{other}" in f], r
    if layout == "fsdp":
        assert "model_0/__1_0.distcp" in ranks[1]["opened_loading"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_a_damaged_file_of_rank_1_fails_the_load_alike_on_both_ranks_under_torchrun(tmp_path, layout):
    start = time.monotonic()
    proc = subprocess.run(torchrun(SCRIPTS / "damaged_shard.py", str(tmp_path), "--layout", layout),
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_ranks(tmp_path, layout)
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_a_damaged_shard_of_rank_1_fails_the_load_alike_under_plain_multiprocessing(tmp_path):
    """No torchrun: its tear-down would hide a rank left waiting in a collective."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "damaged_shard.py"), str(tmp_path), "--spawn",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_ranks(tmp_path, "fsdp")

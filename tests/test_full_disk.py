"""Checkpoints on a really full filesystem: a small tmpfs mounted for the test, so the kernel itself
answers ENOSPC (no mocking, no file size limit).

Each test writes a first checkpoint that fits and then a second one that cannot: either a filler
file takes the space left, or the model is sized so that two checkpoints do not fit in the tmpfs.
Which file meets the full disk is chosen by the sizes: the optimizer state (``torch.save`` through
mixprec's hashing file, so the kernel's ENOSPC is not lost in torch's zip writer's "unexpected
pos"), or the model weights (safetensors, streamed through the same file).

Mounting needs root (as in CI); elsewhere, or where the mount fails (a container without
CAP_SYS_ADMIN), the tests are skipped with the reason.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from mixprec import Accelerator, Trainer, TrainingArguments
from mixprec.checkpoint import verify_checkpoint

from toys import DISK_BYTES, Classifier, blobs, fill

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")



def staging_debris(disk: Path) -> list[str]:
    """The hidden staging folders (``.<name>.tmp-<hex>``) and replaced ones left anywhere on ``disk``."""
    return sorted(str(p.relative_to(disk)) for p in disk.rglob(".*") if re.search(r"\.(tmp|old)-", p.name))


def tensor_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """The bytes of the model's weights and the optimizer's state: what a checkpoint needs at least."""
    tensors = list(model.state_dict().values())
    tensors += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}
    return weights, state


def assert_restored(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: tuple[dict, dict]) -> None:
    weights, state = saved
    now = model.state_dict()
    assert set(now) == set(weights)
    for k, v in weights.items():
        assert torch.equal(now[k], v), f"{k} was not restored bit for bit"
    now_state = dict(enumerate(opt.state.values()))
    assert set(now_state) == set(state)
    for i, s in state.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(now_state[i][k]), torch.as_tensor(v)), f"optimizer state {i}.{k}"


def train_step(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer, dim: int) -> None:
    acc.backward(model(torch.randn(4, dim)).square().mean())
    opt.step()
    opt.zero_grad()


def setup(model: torch.nn.Module, opt_cls, **opt_kw):
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model, opt = acc.prepare(model, opt_cls(model.parameters(), **opt_kw))
    return acc, model, opt


def check_full_disk_error(e: OSError, final: Path, disk: Path, least: int) -> int:
    """The error says ENOSPC, names ``final``, says the disk is full and how many bytes it needs."""
    assert e.errno == errno.ENOSPC, f"errno {e.errno} ({errno.errorcode.get(e.errno)}), not ENOSPC: {e}"
    msg = str(e)
    assert str(final) in msg, msg
    assert "the disk is full" in msg, msg
    m = re.search(r"needs about ([\d,]+) bytes", msg)
    assert m, msg
    need = int(m.group(1).replace(",", ""))
    assert need >= least, f"it says it needs {need:,} bytes; the tensors alone are {least:,}"
    assert need > shutil.disk_usage(disk).free, "it says it needs less than is free"
    return need


def save_twice_and_check(disk: Path, acc, model, opt, dim: int, *, filler_leaves: int | None) -> OSError:
    """Save ``ckpt-1`` (fits), train a step, then save ``ckpt-2`` (cannot fit): check the error, that
    ``ckpt-1`` is complete and restores bit for bit, and that nothing else was left on the disk.
    Returns the error (its ``__cause__`` is the writer's own)."""
    train_step(acc, model, opt, dim)
    first = acc.save_state(disk / "ckpt-1")
    saved = snapshot(model, opt)
    good = verify_checkpoint(first)
    train_step(acc, model, opt, dim)  # the second checkpoint would hold other weights
    if filler_leaves is not None:
        fill(disk, filler_leaves)
    before = sorted(p.name for p in disk.iterdir())
    with pytest.raises(OSError) as info:
        acc.save_state(disk / "ckpt-2")
    check_full_disk_error(info.value, disk / "ckpt-2", disk, tensor_bytes(model, opt))
    assert not (disk / "ckpt-2").exists()
    assert staging_debris(disk) == []
    assert sorted(p.name for p in disk.iterdir()) == before
    assert verify_checkpoint(first) == good  # the previous checkpoint: untouched, complete
    acc.load_state(first)
    assert_restored(model, opt, saved)
    return info.value


# -- the Accelerator -----------------------------------------------------------------------------
def test_save_state_on_a_full_disk_raises_enospc_naming_the_folder_and_the_bytes_and_keeps_the_previous_one(
        disk, one_thread):
    """The disk is filled to the last byte between the two saves: the very first file fails."""
    acc, model, opt = setup(torch.nn.Linear(256, 256), torch.optim.AdamW)
    save_twice_and_check(disk, acc, model, opt, 256, filler_leaves=0)


def test_a_full_disk_met_by_safetensors_writing_the_weights_raises_enospc_and_keeps_the_previous_one(
        disk, one_thread):
    """SGD without momentum keeps no state: the checkpoint is the weights (~2 MiB of the 3 MiB), so
    the second one's ``model_0.safetensors`` meets the full disk (safetensors' "os error 28")."""
    acc, model, opt = setup(torch.nn.Linear(720, 720), torch.optim.SGD, lr=0.1)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert DISK_BYTES / 2 < weights < DISK_BYTES - 64 * 1024  # one fits, two do not
    e = save_twice_and_check(disk, acc, model, opt, 720, filler_leaves=None)
    cause = e.__cause__
    assert isinstance(cause, OSError) and str(cause.filename).endswith("model_0.safetensors"), (
        f"the weights' safetensors write should have failed; the cause was {cause!r}")


def test_a_full_disk_met_by_torch_save_writing_the_optimizer_raises_enospc_and_keeps_the_previous_one(
        disk, one_thread):
    """AdamW's state is twice the weights: the checkpoint is ~1.8 MiB, so the second one's weights
    (0.6 MiB) still fit and its ``optimizer_0.bin`` meets the full disk in torch's zip writer
    (``RuntimeError: [enforce fail at inline_container.cc] ... unexpected pos``)."""
    acc, model, opt = setup(torch.nn.Linear(384, 384), torch.optim.AdamW)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    checkpoint = 3 * weights  # the weights, exp_avg, exp_avg_sq
    # One fits, two do not; and beside the first, the second's weights still fit: its optimizer fails.
    assert checkpoint + weights + 64 * 1024 < DISK_BYTES < 2 * checkpoint
    e = save_twice_and_check(disk, acc, model, opt, 384, filler_leaves=None)
    cause = e.__cause__
    assert isinstance(cause, OSError) and str(cause.filename).endswith("optimizer_0.bin"), (
        f"the optimizer's torch.save should have failed; the cause was {cause!r}")


# -- the Trainer ---------------------------------------------------------------------------------
def test_a_trainer_told_to_warn_trains_past_saves_that_hit_the_full_disk_and_resumes_from_the_last_complete_one(
        disk, caplog, one_thread):
    """checkpoint-2 (~2 MiB: a Classifier with a 8192-wide hidden layer and AdamW) fills most of the
    3 MiB; checkpoint-4 and checkpoint-6 cannot be written: the run warns twice, trains to step 6,
    and checkpoint-2 verifies and resumes to the same weights."""
    out = disk / "run"

    def trainer(output_dir: Path, **kw) -> Trainer:
        args = TrainingArguments(output_dir=str(output_dir), max_steps=6, save_steps=2, per_device_train_batch_size=8,
                                 disable_tqdm=True, report_to="none", on_save_error="warn", use_cpu=True,
                                 logging_steps=100, **kw)
        torch.manual_seed(0)
        return Trainer(model=Classifier(hidden=8192), args=args, train_dataset=blobs(64))

    first = trainer(out)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        result = first.train()
    assert result.global_step == 6 and first.state.global_step == 6
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "checkpoint-" in r.getMessage()]
    assert len(warned) == 2, [r.getMessage() for r in caplog.records]
    for step, msg in zip((4, 6), warned):
        assert str(out / f"checkpoint-{step}") in msg and "the disk is full" in msg and "bytes" in msg, msg
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
    assert staging_debris(disk) == []
    files = verify_checkpoint(out / "checkpoint-2")
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(files)
    final = {k: v.detach().clone() for k, v in first.model.state_dict().items()}

    # Resume: resume_from_checkpoint=True finds checkpoint-2 as the newest complete one (the
    # staging folders of the failed saves are not candidates); its own saves meet the full disk too.
    again = trainer(out)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        result = again.train(resume_from_checkpoint=True)
    assert result.global_step == 6
    resumed = again.model.state_dict()
    for k, v in final.items():
        assert torch.equal(resumed[k], v), f"{k}: the resumed run differs from the uninterrupted one"
    assert verify_checkpoint(out / "checkpoint-2") == files and staging_debris(disk) == []

"""What the house's structure promises: one trigger flag, one PrecisionConfig, the guard a component,
one commit per Trainer checkpoint."""

from __future__ import annotations

import pytest
import torch

import mixprec.checkpoint.folder as folder
from mixprec import Accelerator, Trainer, TrainingArguments
from mixprec.precision import FP32Precision, MixedPrecision, PrecisionConfig, make_plugin
from mixprec.precision.bf16_true import BF16TruePrecision


def test_set_trigger_on_the_accelerator_or_its_state_raises_one_flag():
    acc = Accelerator(cpu=True)
    acc.state.set_trigger()
    assert acc.check_trigger() and not acc.state.check_trigger()  # one flag, reset by the one check
    acc.set_trigger()
    assert acc.state.check_trigger() and not acc.check_trigger()


def test_the_accelerators_parts_are_held_not_inherited():
    acc = Accelerator(cpu=True)
    assert type(acc).__mro__ == (Accelerator, object) and type(acc.state).__mro__[-1] is object
    assert acc.state._processes is acc.processes and acc.checkpointer.prepared is acc.prepared is acc.preparer.prepared
    assert Trainer.__mro__ == (Trainer, object)


@pytest.mark.parametrize("precision, cls", [("fp32", FP32Precision), ("bf16-mixed", MixedPrecision),
                                            ("bf16-true", BF16TruePrecision)])
def test_the_nonfinite_guard_is_a_component_of_each_precisions_own_plugin(precision, cls):
    plugin = make_plugin(precision, "cpu", skip_nonfinite_steps=True, loss_scaler={"max_consecutive_skips": 3})
    assert type(plugin) is cls and plugin.steps is not None
    assert plugin.scaler.get_scale() == 1.0 and plugin.scaler.state_dict()["max_consecutive_skips"] == 3
    assert make_plugin(precision, "cpu").steps is None


def test_one_precision_config_is_taken_by_the_accelerator_and_training_arguments(tmp_path):
    config = PrecisionConfig(skip_nonfinite_steps=True, bf16_true_state_dtype="bf16", on_loss_scale_collapse="fallback")
    acc = Accelerator(mixed_precision="bf16-true", cpu=True, precision_config=config)
    assert acc.precision.config is config and acc.precision.optimizer_state_dtype == torch.bfloat16
    args = TrainingArguments(output_dir=str(tmp_path), precision="bf16-true", skip_nonfinite_steps=True,
                             bf16_true_state_dtype="bf16", on_loss_scale_collapse="fallback")
    assert args.precision_config == config
    with pytest.raises(ValueError, match="not both"):
        Accelerator(cpu=True, precision_config=config, skip_nonfinite_steps=True)
    with pytest.raises(ValueError, match="bf16_true_compensation must be one of 'kahan', 'stochastic', 'none'"):
        PrecisionConfig(bf16_true_compensation="kahn")


def test_a_trainer_checkpoint_is_committed_once_with_hugging_faces_names(tmp_path, monkeypatch):
    commits = []
    real = folder.commit_checkpoint
    monkeypatch.setattr("mixprec.accelerator.checkpointer.commit_checkpoint",
                        lambda tmp, final, meta=None, written=None: commits.append(final) or real(tmp, final, meta,
                                                                                                  written))
    model = torch.nn.Linear(4, 1)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((4,), float(i)), torch.tensor([float(i)])

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.inner(x), y)

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, save_steps=2, per_device_train_batch_size=4,
                             report_to="none", disable_tqdm=True, use_cpu=True)
    Trainer(model=Loss(), args=args, train_dataset=Data()).train()
    ckpt = tmp_path / "checkpoint-2"
    assert commits == [ckpt]
    files = folder.verify_checkpoint(ckpt)  # the Hugging Face names are in the one manifest
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "model_0.safetensors"} <= set(files)
    assert (ckpt / "model.safetensors").stat().st_ino == (ckpt / "model_0.safetensors").stat().st_ino
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_after_reset_state_the_accelerators_process_names_say_so():
    acc = Accelerator(cpu=True)
    acc.state._reset_state()
    for name in ("num_processes", "process_index", "is_main_process", "wait_for_everyone", "set_trigger"):
        with pytest.raises(AttributeError, match=r"_reset_state\(\)` was called"):
            getattr(acc, name)


def test_the_bench_and_the_step_path_branch_on_no_precisions_name():
    """A precision-specific ``if`` belongs in its plugin (DESIGN.md): the bench asks the plugin for its
    variants and the names table for Accelerate's name, and the per-step code reads the plugin."""
    import ast
    from pathlib import Path

    from mixprec.precision import precision_names

    # fp32 aside: it is the reference the bench's speed-ups are against (and a dtype's name). In the
    # bench, every alias too (its rivals speak Accelerate's "bf16"); in the step path the canonical
    # names ("fp16" and "bf16" also name DDP's gradient compression hooks there).
    aliases = {n for canon, names in precision_names().items() if canon not in ("fp32", "auto") for n in names}
    canonical = {canon for canon in precision_names() if canon not in ("fp32", "auto")}
    src = Path(__import__("mixprec").__file__).parent
    bench = [*sorted((src / "apps" / "bench").glob("*.py")), src / "cli" / "bench.py"]
    step = [src / "accelerator" / "wrappers.py", src / "accelerator" / "accelerator.py", src / "data.py", src / "nested.py"]
    found = []
    for f, names in [(f, aliases) for f in bench] + [(f, canonical) for f in step]:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                found += [f"{f.relative_to(src)}:{node.lineno} {c.value!r}" for c in consts]
    assert not found, found

"""What a training step pays for, and only that: the callback handler calls, for each event, only the
callbacks that do something on it (worked out once, again when the callbacks change), so a step pays
nothing for events nobody overrides; and the training forward converts only the loss it keeps."""

from __future__ import annotations

import pytest
import torch

from mixprec import Trainer, TrainingArguments
from mixprec.models import call_model
from mixprec.trainer.callbacks import CallbackHandler, DefaultFlowCallback, TrainerCallback, TrainerControl

from toys import Classifier, blobs


class Counts(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append("step_end")


def test_only_callbacks_that_override_an_event_are_called_for_it():
    counts = Counts()
    handler = CallbackHandler([DefaultFlowCallback, counts])
    assert handler.listeners("on_step_begin") == [] and handler.listeners("on_pre_optimizer_step") == []
    assert handler.listeners("on_step_end") == [handler.callbacks[0], counts]
    handler.call("on_step_begin", None, None, TrainerControl())
    handler.callbacks.pop(0)
    handler.call("on_step_end", None, None, TrainerControl())
    assert counts.seen == ["step_end"]


def test_a_callback_added_later_or_a_method_set_on_an_instance_is_called():
    handler = CallbackHandler([])
    assert handler.listeners("on_log") == []
    late = Counts()
    handler.callbacks.append(late)  # the list changed directly: worked out again
    assert handler.listeners("on_step_end") == [late]
    plain = TrainerCallback()
    calls = []
    plain.on_log = lambda args, state, control, **kw: calls.append(kw["logs"])
    handler.add_callback(plain)
    handler.call("on_log", None, None, TrainerControl(), logs={"loss": 1.0})
    assert calls == [{"loss": 1.0}]


def test_transformers_callbacks_base_no_ops_are_skipped_and_their_overrides_called():
    transformers = pytest.importorskip("transformers")

    class Theirs(transformers.TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    handler = CallbackHandler([Theirs()])
    assert handler.listeners("on_step_end") == [] and len(handler.listeners("on_epoch_end")) == 1
    assert handler.call("on_epoch_end", None, None, TrainerControl()).should_training_stop


def test_the_flags_an_event_clears_are_cleared_even_when_nobody_listens():
    control = TrainerControl(should_log=True, should_save=True)
    CallbackHandler([]).call("on_step_begin", None, None, control)
    assert not control.should_log and not control.should_save


class SquareLoss(Classifier):
    """A loss the model computes in the autocast dtype (``mean`` keeps bf16): converted to fp32 alone."""

    def forward(self, features, labels=None):
        out = super().forward(features, labels)
        return type(out)(loss=out.logits.square().mean(), logits=out.logits)


@pytest.mark.parametrize("model_cls", [Classifier, SquareLoss])
def test_the_training_forward_converts_only_the_loss_and_trains_bit_for_bit_as_when_it_converted_all(
        tmp_path, monkeypatch, model_cls):
    data = blobs(96)

    def run(convert_all):
        with monkeypatch.context() as m:
            if convert_all:  # the previous behaviour: the prepared forward converts every output
                m.setattr(Trainer, "_forward_for_loss", lambda self, model, inputs: call_model(model, inputs, self.model))
            torch.manual_seed(0)
            model = model_cls(hidden=32)
            seen = []
            model.register_forward_hook(lambda mod, inp, out: seen.append((out.logits.dtype, out.loss.dtype)))
            a = TrainingArguments(output_dir=str(tmp_path / "out"), bf16=True, use_cpu=True, disable_tqdm=True,
                                  per_device_train_batch_size=16, num_train_epochs=2, logging_steps=1,
                                  save_strategy="no", report_to="none", learning_rate=1e-2)
            trainer = Trainer(model=model, args=a, train_dataset=data)
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return [p.detach().clone() for p in model.parameters()], losses, seen, trainer

    weights_all, losses_all, seen_all, _ = run(convert_all=True)
    weights, losses, seen, trainer = run(convert_all=False)
    assert len(losses) == 12 and losses == losses_all
    assert all(torch.equal(p, q) for p, q in zip(weights, weights_all))
    assert seen_all[0][0] == torch.float32 and seen[0][0] == torch.bfloat16  # the logits nobody kept: as computed
    batch = next(iter(trainer.get_train_dataloader()))
    assert trainer.compute_loss(trainer.model_wrapped, batch).dtype == torch.float32
    loss, outputs = trainer.compute_loss(trainer.model_wrapped, batch, return_outputs=True)
    assert loss.dtype == outputs.logits.dtype == torch.float32  # outputs handed back: converted, as Accelerate's


def test_the_fast_paths_train_bit_for_bit_as_torchs_own_calls(tmp_path):
    """Under a profiler every torch call is made as torch makes it (the optimizer's step and
    zero_grad with their wrappers and groups one by one, the loader's __next__): the same run
    without one (the fast paths) gives the same logged losses and weights, bit for bit."""
    from mixprec.tasks.digits import DigitsDataset, DigitsMLP

    data = DigitsDataset("train")

    def run(profiled):
        torch.manual_seed(0)
        model = DigitsMLP(hidden_size=32)
        a = TrainingArguments(output_dir=str(tmp_path / "out"), bf16=True, use_cpu=True, disable_tqdm=True,
                              optim="adamw_torch_fused", max_grad_norm=1.0, per_device_train_batch_size=64,
                              max_steps=30, logging_steps=1, save_strategy="no", report_to="none")
        trainer = Trainer(model=model, args=a, train_dataset=data)
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                trainer.train()
            names = {e.name for e in prof.events()}
            assert any(n.startswith("Optimizer.step#") for n in names)
            assert any(n.startswith("enumerate(DataLoader)#") for n in names)
        else:
            trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return [p.detach().clone() for p in model.parameters()], losses

    weights, losses = run(profiled=False)
    ref_weights, ref_losses = run(profiled=True)
    assert len(losses) == 30 and losses == ref_losses
    assert all(torch.equal(p, q) for p, q in zip(weights, ref_weights))

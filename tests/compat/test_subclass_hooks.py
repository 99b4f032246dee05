"""A Trainer subclass written against transformers' Trainer runs on mixprec's with the import
changed: the overrides a user (or a library built on the Trainer) writes, each calling ``super()``
with transformers' arguments, are called by mixprec's loop, and the run ends where transformers'
does. And an Accelerate loop's calls with Accelerate's keywords bind."""

from __future__ import annotations

import json

import pytest
import torch

import mixprec

from toys import SineRegressor, SineRows

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _subclass(base: type) -> type:
    """The same class body over ``base``: every override records its call and passes it on."""

    class Recording(base):
        calls: list[str]

        def create_optimizer(self, model=None):
            self.calls.append(f"create_optimizer({type(model).__name__})")
            return super().create_optimizer(model)

        def get_decay_parameter_names(self, model):  # no decay anywhere: the rule a subclass sets holds
            self.calls.append("get_decay_parameter_names")
            return []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.calls.append("training_step")
            return super().training_step(model, inputs, num_items_in_batch)

        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                     start_time, learning_rate=None):
            if self.control.should_log:
                self.calls.append("log")
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                             start_time, learning_rate=learning_rate)

        def _save_checkpoint(self, model, trial):
            self.calls.append(f"save@{self.state.global_step}")
            return super()._save_checkpoint(model, trial)

        def _get_train_sampler(self, train_dataset=None):  # the dataset backwards: a sampler of the subclass's own
            self.calls.append("sampler")
            return list(range(len(train_dataset if train_dataset is not None else self.train_dataset)))[::-1]

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = self._prepare_inputs(inputs)  # (a common line of custom losses)
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

        def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=False):
            self.calls.append(f"evaluate@{self.state.global_step}")
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)

        def _determine_best_metric(self, metrics, trial):
            self.calls.append("best?")
            return super()._determine_best_metric(metrics, trial)

    return Recording


def _run(base: type, args_cls: type, out: str) -> tuple[object, dict]:
    args = args_cls(output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
                    weight_decay=0.5, logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                    save_steps=3, metric_for_best_model="loss", greater_is_better=False, report_to="none",
                    disable_tqdm=True, use_cpu=True, seed=3, train_sampling_strategy="sequential")
    trainer = _subclass(base)(model=SineRegressor(), args=args, train_dataset=SineRows(), eval_dataset=SineRows())
    trainer.calls = []
    trainer.train()
    return trainer, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_a_subclass_overriding_transformers_hooks_runs_on_mixprec_as_on_transformers(tmp_path, one_thread):
    theirs, their_weights = _run(transformers.Trainer, transformers.TrainingArguments, str(tmp_path / "hf"))
    ours, our_weights = _run(mixprec.Trainer, mixprec.TrainingArguments, str(tmp_path / "mp"))
    def before_training(calls):  # (transformers makes the loader before the optimizer, mixprec after: either order)
        return sorted(calls[:calls.index("training_step")])

    assert before_training(ours.calls) == before_training(theirs.calls) == [
        "create_optimizer(NoneType)", "get_decay_parameter_names", "sampler"]
    for name in ("training_step", "log", "save@3", "save@6", "sampler", "evaluate@3", "evaluate@6", "best?"):
        assert ours.calls.count(name) == theirs.calls.count(name), name
    assert ours.calls.count("sampler") >= 1 and ours.calls.count("best?") == 2
    # The subclass's decay rule (none) and its sampler (the rows backwards) held in both: the same weights.
    assert all(g["weight_decay"] == 0.0 for g in ours.optimizer.param_groups if g["params"])
    for k in their_weights:
        torch.testing.assert_close(our_weights[k], their_weights[k], rtol=1e-5, atol=1e-6)
    for trainer in (theirs, ours):  # the best checkpoint, as each recorded it
        step = trainer.state.best_global_step
        assert step in (3, 6) and trainer.state.best_model_checkpoint.endswith(f"checkpoint-{step}")
    assert ours.state.best_global_step == theirs.state.best_global_step


def test_trainer_state_and_callbacks_take_transformers_keywords(tmp_path):
    state = mixprec.TrainerState(global_step=7)
    state.save_to_json(json_path=str(tmp_path / "trainer_state.json"))
    assert mixprec.TrainerState.load_from_json(json_path=str(tmp_path / "trainer_state.json")).global_step == 7
    assert json.loads((tmp_path / "trainer_state.json").read_text())["global_step"] == 7

    class OnPredict(mixprec.TrainerCallback):
        def on_predict(self, args, state, control, metrics, **kwargs):
            self.seen = metrics
            return super().on_predict(args, state, control, metrics, **kwargs)  # transformers' positional call

    cb = OnPredict()
    cb.on_predict(None, state, mixprec.TrainerControl(), {"test_loss": 1.0})
    assert cb.seen == {"test_loss": 1.0}


def test_an_accelerate_loops_keywords_bind_and_do_what_they_say():
    acc = mixprec.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
    assert acc.prepare_data_loader(data_loader=dl, device_placement=False).device is None
    assert acc.prepare_data_loader(dl, device_placement=True).device == acc.device
    assert acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False) \
        .device_placement is False
    with pytest.raises(NotImplementedError, match="slice_fn_for_dispatch.*leave it out"):
        acc.prepare_data_loader(dl, slice_fn_for_dispatch=lambda batch, i: batch)
    # scale: one process, so the reduction is the tensor itself, scaled (Accelerate ignores it off XLA)
    assert torch.equal(acc.reduce(torch.tensor([1.0, 2.0]), "sum", scale=0.5), torch.tensor([0.5, 1.0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model2, opt2, dl2 = acc.prepare(torch.nn.Linear(2, 1), opt, dl, device_placement=[True, False, False])
    assert opt2.device_placement is False and dl2.device is None

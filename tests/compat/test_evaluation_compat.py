"""evaluate() and predict() as transformers': through evaluation_loop (an override of it is
used), the loss from compute_loss (an override's and label smoothing count), the same metric
names (steps per second, the model's preparation time, the epoch) before and after training."""

from __future__ import annotations

import math
import time
import types

import pytest
import torch

import mixprec

from toys import SineRegressor, SineRows

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _args(lib, tmp_path, **more):
    return lib.TrainingArguments(output_dir=str(tmp_path / lib.__name__), report_to="none", use_cpu=True,
                                 max_steps=2, save_strategy="no", disable_tqdm=True, seed=3, **more)


def test_the_metrics_evaluate_and_predict_return_have_transformers_names(tmp_path):
    names = {}
    for lib in (transformers, mixprec):
        trainer = lib.Trainer(model=SineRegressor(), args=_args(lib, tmp_path), train_dataset=SineRows(),
                              eval_dataset=SineRows())
        before = trainer.evaluate()
        trainer.train()
        names[lib.__name__] = (sorted(before), sorted(trainer.evaluate()), sorted(trainer.predict(SineRows()).metrics))
    assert names["mixprec"] == names["transformers"]
    assert "eval_steps_per_second" in names["mixprec"][0] and "epoch" in names["mixprec"][1]


def test_a_trainer_trained_before_its_first_evaluation_reports_no_preparation_time(tmp_path):
    names = {}
    for lib in (transformers, mixprec):
        trainer = lib.Trainer(model=SineRegressor(), args=_args(lib, tmp_path), train_dataset=SineRows(),
                              eval_dataset=SineRows())
        trainer.train()
        names[lib.__name__] = sorted(trainer.evaluate())
    assert names["mixprec"] == names["transformers"] and "eval_model_preparation_time" not in names["mixprec"]


@pytest.mark.parametrize("lib", [transformers, mixprec], ids=["transformers", "mixprec"])
def test_evaluation_scores_with_an_overridden_compute_loss_and_goes_through_evaluation_loop(lib, tmp_path):
    seen = []

    class Doubled(lib.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
            return (2 * loss, outputs) if return_outputs else 2 * loss

        def evaluation_loop(self, dataloader, description, *args, **kwargs):
            seen.append(description)
            return super().evaluation_loop(dataloader, description, *args, **kwargs)

    plain = lib.Trainer(model=SineRegressor(), args=_args(lib, tmp_path), eval_dataset=SineRows())
    doubled = Doubled(model=SineRegressor(), args=_args(lib, tmp_path), eval_dataset=SineRows())
    doubled.model.load_state_dict(plain.model.state_dict())
    assert math.isclose(doubled.evaluate()["eval_loss"], 2 * plain.evaluate()["eval_loss"], rel_tol=1e-6)
    doubled.predict(SineRows())
    assert seen == ["Evaluation", "Prediction"]


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 3)
        self.config = types.SimpleNamespace(problem_type="single_label_classification")  # transformers reads it

    def forward(self, x, labels=None):
        logits = self.net(x)
        if labels is None:  # (label smoothing: the Trainer takes the labels and computes the loss)
            return {"logits": logits}
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_the_eval_loss_is_label_smoothed_as_transformers_smooths_it(tmp_path):
    g = torch.Generator().manual_seed(1)
    rows = [{"x": torch.randn(4, generator=g), "labels": int(torch.randint(0, 3, (1,), generator=g))} for _ in range(24)]
    losses = {lib.__name__: lib.Trainer(model=_Classifier(), args=_args(lib, tmp_path, label_smoothing_factor=0.2),
                                        eval_dataset=rows).evaluate()["eval_loss"] for lib in (transformers, mixprec)}
    unsmoothed = mixprec.Trainer(model=_Classifier(), args=_args(mixprec, tmp_path), eval_dataset=rows).evaluate()
    assert math.isclose(losses["mixprec"], losses["transformers"], rel_tol=1e-6)
    assert not math.isclose(losses["mixprec"], unsmoothed["eval_loss"], rel_tol=1e-3)


@pytest.mark.parametrize("lib", [transformers, mixprec], ids=["transformers", "mixprec"])
def test_a_trainer_subclass_that_runs_its_own_evaluation_as_transformers_question_answering_example(lib, tmp_path):
    """The shape of transformers' ``examples/pytorch/question-answering/trainer_qa.py``: the
    loop run by hand, metrics computed after it, the callbacks told positionally."""
    from transformers.trainer_utils import speed_metrics

    seen = []

    class Recorder(lib.TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.append(sorted(metrics))

    class PostProcessed(lib.Trainer):
        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            dataloader = self.get_eval_dataloader(eval_dataset)
            compute_metrics, self.compute_metrics = self.compute_metrics, None
            start = time.time()
            try:
                output = self.evaluation_loop(dataloader, description="Evaluation", prediction_loss_only=None,
                                              ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            finally:
                self.compute_metrics = compute_metrics
            output.metrics.update(speed_metrics(metric_key_prefix, start, num_samples=output.num_samples))
            metrics = {**self.compute_metrics(output.predictions), **output.metrics}
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    trainer = PostProcessed(model=SineRegressor(), args=_args(lib, tmp_path), eval_dataset=SineRows(),
                            compute_metrics=lambda predictions: {"eval_mean": float(predictions.mean())},
                            callbacks=[Recorder()])
    metrics = trainer.evaluate()
    assert {"eval_mean", "eval_loss", "eval_samples_per_second"} <= set(metrics) and seen == [sorted(metrics)]


def test_gather_function_and_is_fsdp_enabled_follow_the_accelerator_a_new_model_brings(tmp_path):
    """model_init makes a fresh Accelerator for every train(): the attributes transformers sets
    with it are set again (a stale gather_function would gather through the old one)."""
    trainer = mixprec.Trainer(model_init=SineRegressor, args=_args(mixprec, tmp_path), train_dataset=SineRows(),
                              eval_dataset=SineRows())
    first = trainer.accelerator
    trainer.train()
    assert trainer.accelerator is not first and trainer.gather_function.func.__self__ is trainer.accelerator
    assert trainer.is_fsdp_enabled is False and "eval_loss" in trainer.evaluate()


@pytest.mark.parametrize("lib", [transformers, mixprec], ids=["transformers", "mixprec"])
def test_the_evaluation_loop_gathers_each_batchs_predictions_and_labels_through_trainer_gather_function(lib, tmp_path):
    """``trainer.gather_function`` (what transformers' evaluation loop calls, and code that gathers
    otherwise replaces) is called with each batch's predictions and labels, and what it returns is
    what ``compute_metrics`` receives: a gather marked +1000 shows in both."""
    seen, calls = {}, []

    def metrics(p):
        seen["predictions"], seen["labels"] = p.predictions, p.label_ids
        return {}

    def gather(tensor):
        calls.append(tensor.detach().clone())
        return tensor + 1000

    rows = SineRows()
    trainer = lib.Trainer(model=SineRegressor(), args=_args(lib, tmp_path, per_device_eval_batch_size=16),
                          eval_dataset=rows, compute_metrics=metrics)
    trainer.gather_function = gather
    trainer.evaluate()
    with torch.no_grad():
        predictions = SineRegressor()(rows.x, rows.y)["logits"]
    for batch in (slice(0, 16), slice(16, 32), slice(32, 40)):
        assert any(c.shape == rows.y[batch].shape and torch.equal(c, rows.y[batch]) for c in calls), batch
        assert any(c.shape == predictions[batch].shape and torch.allclose(c, predictions[batch]) for c in calls), batch
    assert torch.equal(torch.as_tensor(seen["labels"]), rows.y + 1000)
    assert torch.allclose(torch.as_tensor(seen["predictions"]), predictions + 1000)

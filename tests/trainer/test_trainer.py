"""Trainer: the seed's snippet, evaluation, best checkpoints, early stopping, data handling, logging."""

from __future__ import annotations

import json
import sys

import pytest
import safetensors.torch
import torch

from mixprec import (
    EarlyStoppingCallback,
    LossScaleCollapse,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from toys import SCRIPTS, Classifier, Preloaded, accuracy_metrics, blobs

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), disable_tqdm=True, per_device_train_batch_size=16,
                learning_rate=1e-2, num_train_epochs=2, logging_steps=5, save_strategy="no")
    base.update(kw)
    return TrainingArguments(**base)


def test_seed_trainer_snippet_trains_evaluates_every_epoch_and_logs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = Classifier()
    dataset = {"train": blobs(2000), "validation": blobs(200, seed=1)}
    compute_metrics = accuracy_metrics
    # The seed's Trainer snippet, verbatim apart from the import.
    with pytest.warns(FutureWarning, match="evaluation_strategy"):
        training_args = TrainingArguments(
            output_dir="./results",
            evaluation_strategy="epoch",
            fp16=True
        )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"],
        eval_dataset=dataset["validation"],
        compute_metrics=compute_metrics,
    )
    trainer.train()
    assert training_args.eval_strategy == "epoch"
    rows = [json.loads(line) for line in (tmp_path / "results" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [round(r["epoch"]) for r in evals] == [1, 2, 3]
    assert evals[-1]["eval_accuracy"] > 0.5  # chance is 0.25
    assert trainer.accelerator.policy.name == "fp16-mixed" and trainer.state.loss_scale is not None
    assert trainer.model is model


RESUME_SCRIPT = SCRIPTS / "resume_trainer.py"


#: The script's runs start forked from a process that has imported torch and what mixprec's Trainer
#: imports of transformers in any process (its schedules), each run still a process of its own,
#: killed and restarted as one.
PRELOADED = Preloaded("torch", "safetensors.torch", "transformers", "transformers.optimization")


def resume_script(out, *extra, code=0):
    """Run tests/scripts/resume_trainer.py into ``out``; ``code`` is the exit status expected (-9: SIGKILLed)."""
    p = PRELOADED.run(RESUME_SCRIPT, str(out), *extra, logs=out.parent, timeout=300)
    assert p.returncode == code, p.stderr[-3000:]
    return p


def jsonl_rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def same_weights(a, b):
    wa = safetensors.torch.load_file(str(a / "final.safetensors"))
    wb = safetensors.torch.load_file(str(b / "final.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """``get(precision)``: tests/scripts/resume_trainer.py run uninterrupted (``full``) and, in
    ``faults``, through three faults one after the other, each restart resuming what the fault
    before it left (made once per precision, for the tests below):

    1. SIGKILL in the middle of the third save (checkpoint-15's files half written);
    2. resumed from checkpoint-10, SIGTERM at step 13 (a preemption: the step finishes,
       checkpoint-13 is saved, the exit status is 75);
    3. resumed from checkpoint-13, SIGKILL at step 17 (12 steps per epoch: mid second epoch),
       after checkpoint-15 and the log of step 16;
    4. resumed from checkpoint-15 to the end.

    In fp32 both runs also have two persistent dataloader workers (restarted mid-epoch by each
    resume) and report to TensorBoard. Returns the two folders and, after each fault, the
    checkpoints there and the run's stderr."""
    made = {}

    def get(precision):
        if precision not in made:
            root = tmp_path_factory.mktemp(f"faults-{precision}")
            more = ("--workers", "2", "--report-to", "jsonl,tensorboard") if precision == "fp32" else ()
            flags = ("--precision", precision, *more)

            def checkpoints():
                return sorted((p.name for p in (root / "faults").glob("checkpoint-*")), key=lambda n: int(n[11:]))

            resume_script(root / "full", *flags)
            after = []
            for fault, code in ((("--kill-in-save", "3"), -9), (("--resume", "--sigterm-at", "13"), 75),
                                (("--resume", "--kill-at", "17"), -9), (("--resume",), 0)):
                proc = resume_script(root / "faults", *flags, *fault, code=code)
                after.append((checkpoints(), proc.stderr))
            made[precision] = (root / "full", root / "faults", after)
        return made[precision]
    return get


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_faults")
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_train_killed_mid_epoch_and_resumed_equals_uninterrupted_bit_for_bit(faults, precision):
    """SIGKILL mid-save, SIGTERM (preemption) and SIGKILL mid-epoch: each restart resumes what the
    fault left, and the run ends bit for bit as the uninterrupted one, each step logged once."""
    full, out, after = faults(precision)
    assert after[0][0] == ["checkpoint-5", "checkpoint-10"]  # checkpoint-15's save died: no folder of that name
    assert "SIGTERM received; stopped after step 13" in after[1][1]
    assert after[1][0] == ["checkpoint-5", "checkpoint-10", "checkpoint-13"]
    assert after[2][0] == ["checkpoint-5", "checkpoint-10", "checkpoint-13", "checkpoint-15"]
    # Each logged step is in metrics.jsonl once (the killed runs had logged past their last
    # checkpoint), with the uninterrupted run's values.
    def steps(run):
        return [(r["step"], sorted(k for k in r if k not in ("train_runtime", "train_samples_per_second",
                                                                 "train_steps_per_second"))) for r in jsonl_rows(run)]
    assert steps(out) == steps(full)
    assert [r.get("loss") for r in jsonl_rows(out)] == [r.get("loss") for r in jsonl_rows(full)]
    assert same_weights(full, out)


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_faults")
def test_mid_epoch_resume_with_two_persistent_workers_is_bit_for_bit(faults):
    """dataloader_num_workers=2, persistent_workers=True: a SIGKILL in the second epoch, then a resume
    (which starts the workers in that epoch), gives the uninterrupted run's weights and logs."""
    full, out, after = faults("fp32")
    assert after[2][0][-1] == "checkpoint-15"  # the last resume starts the workers at step 16, mid-epoch
    assert same_weights(full, out)
    def losses(out):
        return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in jsonl_rows(out)]
    assert losses(out) == losses(full)


@pytest.mark.slow
@pytest.mark.xdist_group("trainer_faults")
def test_tensorboard_and_log_history_hold_each_step_once_after_sigkill_and_sigterm_resumes(faults):
    """After a SIGKILL past the last checkpoint (steps 16-17 logged, then replayed) and a SIGTERM, the
    resumed run's TensorBoard scalars (as TensorBoard reads them), metrics.jsonl and
    trainer_state.json's log_history hold each step once, with the uninterrupted run's values."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    full, out, _ = faults("fp32")

    def scalars(out):
        ea = EventAccumulator(str(out / "runs"))  # every events file of the run folder, purges applied
        ea.Reload()
        return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}

    def history(out):
        return json.loads((out / "trainer_state.json").read_text())["log_history"]

    theirs = scalars(full)
    assert [s for s, _ in theirs["train/loss"]] == [4, 8, 12, 16, 20, 24]
    got = scalars(out)
    assert got.keys() == theirs.keys()
    for tag, points in theirs.items():
        if tag.startswith(("train/train_", "eval/runtime", "eval/samples", "eval/steps")):
            assert [s for s, _ in got[tag]] == [s for s, _ in points], tag  # timings differ
        else:
            assert got[tag] == points, tag
    rows, hist = jsonl_rows(out), history(out)
    assert [r["step"] for r in rows] == [h["step"] for h in hist] == [h["step"] for h in history(full)]
    for r, h in zip(rows, hist):
        assert r == {k: (None if isinstance(v, float) and v != v else v) for k, v in h.items()}


class Scripted:
    """compute_metrics returning a scripted score per evaluation, to know which checkpoint is best."""

    def __init__(self, scores):
        self.scores, self.calls = scores, 0

    def __call__(self, eval_pred):
        score = self.scores[min(self.calls, len(self.scores) - 1)]
        self.calls += 1
        return {"score": score}


class Snapshots(TrainerCallback):
    def __init__(self):
        self.at_eval = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.at_eval.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def test_load_best_model_at_end_restores_the_best_and_save_total_limit_1_keeps_it(tmp_path):
    snaps = Snapshots()
    torch.manual_seed(0)
    model = Classifier()
    trainer = Trainer(model=model, args=args(tmp_path, eval_strategy="steps", eval_steps=4, save_strategy="steps",
                                             save_steps=4, load_best_model_at_end=True, metric_for_best_model="score",
                                             save_total_limit=1, max_steps=16),
                      train_dataset=blobs(256), eval_dataset=blobs(32, seed=1),
                      compute_metrics=Scripted([1.0, 5.0, 2.0, 3.0]), callbacks=[snaps])
    trainer.train()
    assert trainer.state.best_metric == 5.0
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-8")
    kept = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert kept == ["checkpoint-16", "checkpoint-8"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, snaps.at_eval[1][k])  # the weights of the second evaluation, the best


def test_early_stopping_stops(tmp_path):
    trainer = Trainer(model=Classifier(), args=args(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                                                   save_steps=2, load_best_model_at_end=True,
                                                   metric_for_best_model="score", max_steps=50),
                      train_dataset=blobs(256), eval_dataset=blobs(32, seed=1),
                      compute_metrics=Scripted([3.0, 2.0, 1.0, 0.5]),
                      callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    out = trainer.train()
    assert out.global_step == 6  # best at the first evaluation, two without improvement, stop


@pytest.mark.parametrize("kwargs, match", [
    (dict(fp16=True, bf16=True), "set only one"),
    (dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps"), "to match"),
    (dict(load_best_model_at_end=True, eval_strategy="no"), "needs evaluation"),
    (dict(eval_strategy="sometimes"), "eval_strategy='sometimes' is not valid; choose one of"),
    (dict(optim="lion"), "optim='lion'"),
    (dict(precision="fp12"), "Valid names"),
    (dict(precision="bf16", fp16=True), "contradicts"),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size must be"),
    (dict(warmup_ratio=1.5), "warmup_ratio"),
    (dict(report_to="wandbb"), "report_to"),
    (dict(bf16_true_compensation="kahn"), "'kahan', 'stochastic', 'none'"),
    (dict(bf16_true_state_dtype="fp16"), "'fp32', 'bf16'"),
])
def test_contradictions_and_bad_values_raise_errors_that_say_the_fix(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(output_dir=str(tmp_path), **kwargs)


def test_bf16_true_trains_with_the_compensation_and_moments_the_arguments_name(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(model=Classifier(), args=args(tmp_path, precision="bf16-true", num_train_epochs=1,
                                                   bf16_true_compensation="stochastic", bf16_true_state_dtype="bf16"),
                      train_dataset=blobs(256))
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert type(opt).__module__ == "mixprec.precision.optim.compensated" and opt.defaults["compensation"] == "stochastic"
    state = next(s for p, s in opt.state.items() if p.dtype == torch.bfloat16)
    assert state["exp_avg"].dtype == torch.bfloat16
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) >= 2 and losses[-1] < losses[0]  # it learns


def test_a_best_metric_that_evaluation_never_produces_fails_at_the_first_evaluation(tmp_path):
    trainer = Trainer(model=Classifier(), args=args(tmp_path, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                                                   save_steps=2, save_total_limit=1, load_best_model_at_end=True,
                                                   metric_for_best_model="f1", max_steps=10),
                      train_dataset=blobs(128), eval_dataset=blobs(32, seed=1), compute_metrics=accuracy_metrics)
    with pytest.raises(ValueError, match="'eval_f1'.*eval_accuracy"):
        trainer.train()
    assert trainer.state.global_step == 2 and not list((tmp_path / "out").glob("checkpoint-*"))


class NoLabels(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)

    def forward(self, features, labels=None):
        return {"logits": self.lin(features)}


def test_a_model_with_no_loss_and_no_labels_says_so(tmp_path):
    data = [{"features": s["features"]} for s in blobs(32)]
    trainer = Trainer(model=NoLabels(), args=args(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match="returned no loss.*no label column 'labels'"):
        trainer.train()


def test_a_column_the_forward_does_not_accept_is_named_with_the_signature(tmp_path):
    data = [{**s, "extra": 1} for s in blobs(32)]
    trainer = Trainer(model=Classifier(), args=args(tmp_path, remove_unused_columns=False), train_dataset=data)
    with pytest.raises(ValueError, match=r"column 'extra' that Classifier.forward\(features, labels=None\)"):
        trainer.train()


def test_unused_columns_are_removed_by_default(tmp_path):
    """A column forward does not accept is dropped (Hugging Face's default); a forward that takes
    **kwargs accepts every column, so there nothing is dropped (Hugging Face would drop them)."""
    data = [{**s, "extra": 1} for s in blobs(64)]

    def trained_with(model, **kw):
        seen = set()
        model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
        Trainer(model=model, args=args(tmp_path, max_steps=2, **kw), train_dataset=data).train()
        return seen

    class TakesKwargs(Classifier):
        def forward(self, features, labels=None, **kwargs):
            return super().forward(features, labels)

    assert trained_with(Classifier()) == {"features", "labels"}  # forward(features, labels)
    assert trained_with(TakesKwargs()) == {"features", "labels", "extra"}
    with pytest.raises(ValueError, match="column 'extra' that Classifier.forward.*does not accept"):
        trained_with(Classifier(), remove_unused_columns=False)


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, samples):
        self.samples, self.getitem, self.getitems = samples, 0, 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.getitem += 1
        return self.samples[i]

    def __getitems__(self, indices):
        self.getitems += 1
        batch = [self.samples[i] for i in indices]
        return {"features": torch.stack([b["features"] for b in batch]),
                "labels": torch.tensor([b["label"] for b in batch])}


def test_batches_are_fetched_whole_where_the_dataset_allows_it(tmp_path):
    ds = CountingDataset(blobs(64))
    Trainer(model=Classifier(), args=args(tmp_path, max_steps=4), train_dataset=ds).train()
    assert ds.getitem == 0 and ds.getitems == 4


def test_plain_module_returning_a_loss_tensor_and_tuple_batches(tmp_path):
    class Reg(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.lin(x), y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    trainer = Trainer(model=Reg(), args=args(tmp_path, num_train_epochs=5, learning_rate=0.1, eval_strategy="epoch"),
                      train_dataset=ds, eval_dataset=ds)
    trainer.train()
    losses = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    assert len(losses) == 5 and losses[-1] < 0.2 * losses[0]


def test_callbacks_see_hugging_face_events_in_order(tmp_path):
    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

    rec = Recorder()
    for name in ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_optimizer_step",
                 "on_step_end", "on_evaluate", "on_save", "on_log", "on_epoch_end", "on_train_end"):
        setattr(rec, name, (lambda n: lambda a, s, c, **k: rec.events.append(n))(name))
    Trainer(model=Classifier(), args=args(tmp_path, num_train_epochs=1, eval_strategy="epoch", save_strategy="epoch",
                                          logging_steps=100), train_dataset=blobs(32), eval_dataset=blobs(16),
            callbacks=[rec]).train()
    e = rec.events
    assert e[:5] == ["on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_optimizer_step"]
    assert e.index("on_epoch_end") < e.index("on_evaluate") < e.index("on_save") < e.index("on_train_end")
    assert e.count("on_step_end") == 2 and e[-1] == "on_train_end"


def test_skipped_steps_are_summarised_once_per_log_not_per_step(tmp_path, capsys):
    trainer = Trainer(model=Classifier(), args=args(tmp_path, fp16=True, disable_tqdm=False, max_steps=10,
                                                    logging_steps=5, loss_scaler={"init_scale": 2.0**60}),
                      train_dataset=blobs(256))
    trainer.train()
    captured = capsys.readouterr()
    lines = [ln for ln in (captured.out + captured.err).splitlines() if "skipped for overflow" in ln]
    assert 1 <= len(lines) <= 2 and "scale" in lines[0]
    assert trainer.state.skipped_steps >= 3
    # Each log names the steps skipped since the previous one, as many as its count went up by.
    logged = [h for h in trainer.state.log_history if "skipped_steps_at" in h]
    before_step, before_count = 0, 0
    for h in logged:
        assert len(h["skipped_steps_at"]) == h["skipped_steps"] - before_count
        assert all(before_step < s <= h["step"] for s in h["skipped_steps_at"]), h
        before_step, before_count = h["step"], h["skipped_steps"]
    assert sum(len(h["skipped_steps_at"]) for h in logged) >= 3
    assert f"step{'s' if len(logged[0]['skipped_steps_at']) > 1 else ''} " + \
        ", ".join(map(str, logged[0]["skipped_steps_at"])) in lines[0]


def test_loss_scale_collapse_is_raised_through_the_trainer_with_the_fix(tmp_path):
    trainer = Trainer(model=Classifier(), args=args(tmp_path, fp16=True, max_steps=20,
                                                    loss_scaler={"init_scale": 2.0**120, "max_consecutive_skips": 3}),
                      train_dataset=blobs(256))
    with pytest.raises(LossScaleCollapse, match="bf16-mixed"):
        trainer.train()


def test_tensorboard_logs_when_asked(tmp_path):
    pytest.importorskip("tensorboard")
    Trainer(model=Classifier(), args=args(tmp_path, max_steps=5, logging_steps=1, report_to="tensorboard"),
            train_dataset=blobs(128)).train()
    assert list((tmp_path / "out" / "runs").glob("events.out.tfevents.*"))


def test_tensorboard_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        Trainer(model=Classifier(), args=args(tmp_path, report_to="tensorboard"), train_dataset=blobs(8))


def test_predict_returns_numpy_predictions_labels_and_metrics(tmp_path):
    trainer = Trainer(model=Classifier(), args=args(tmp_path, bf16=True), compute_metrics=accuracy_metrics,
                      train_dataset=blobs(512))
    trainer.train()
    out = trainer.predict(blobs(50, seed=3))
    assert out.predictions.shape == (50, 4) and out.label_ids.shape == (50,)
    assert out.metrics["test_accuracy"] > 0.5 and "test_loss" in out.metrics


def test_evaluate_on_a_dict_of_datasets_prefixes_each(tmp_path):
    trainer = Trainer(model=Classifier(), args=args(tmp_path), compute_metrics=accuracy_metrics,
                      eval_dataset={"a": blobs(20), "b": blobs(30, seed=2)})
    m = trainer.evaluate()
    assert {"eval_a_accuracy", "eval_b_accuracy", "eval_a_loss", "eval_b_loss"} <= set(m)


def test_training_arguments_round_trip_through_json_and_toml(tmp_path):
    a = TrainingArguments(output_dir="x", eval_strategy="steps", eval_steps=7, bf16=True, label_names=["labels"])
    a.to_json_file(tmp_path / "a.json")
    assert TrainingArguments.from_json_file(tmp_path / "a.json") == a
    (tmp_path / "c.toml").write_text('[training]\noutput_dir = "x"\nlearning_rate = 0.001\nbf16 = true\n')
    b = TrainingArguments.from_toml(tmp_path / "c.toml")
    assert b.learning_rate == 0.001 and b.resolved_precision == "bf16-mixed"
    with pytest.raises(ValueError, match="unknown TrainingArguments key.*'learnin_rate'.*valid keys"):
        TrainingArguments.from_dict({"learnin_rate": 1})
    assert a.replace(learning_rate=0.5).learning_rate == 0.5 and a.learning_rate != 0.5
    a.learning_rate = 3.0  # mutable, as Hugging Face's: assigned fields are checked by validate()
    assert a.learning_rate == 3.0
    a.learning_rate = -1.0
    with pytest.raises(ValueError, match="learning_rate must be"):
        a.validate()


def test_save_model_writes_safetensors(tmp_path):
    trainer = Trainer(model=Classifier(), args=args(tmp_path))
    out = trainer.save_model(str(tmp_path / "model"))
    assert (out / "model.safetensors").exists() and (out / "training_args.json").exists()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_real_hugging_face_bert_with_a_datasets_dataset(tmp_path, precision):
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 64, (256, 12), generator=g)
    labels = (ids[:, 0] > 34).long()  # the class is readable from the first token
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                     "label": labels.tolist(), "text": ["unused"] * 256})
    split = ds.train_test_split(test_size=0.25, seed=0)
    trainer = Trainer(model=model, args=args(tmp_path, num_train_epochs=6, learning_rate=3e-3, eval_strategy="epoch",
                                             **{precision: True}),
                      train_dataset=split["train"], eval_dataset=split["test"], compute_metrics=accuracy_metrics)
    trainer.train()
    acc = [r["eval_accuracy"] for r in trainer.state.log_history if "eval_accuracy" in r]
    assert len(acc) == 6 and acc[-1] > 0.75


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        yield from self.samples


def test_iterable_datasets_train_for_max_steps_and_need_it(tmp_path):
    out = Trainer(model=Classifier(), args=args(tmp_path, max_steps=5), train_dataset=Stream(blobs(200))).train()
    assert out.global_step == 5
    with pytest.raises(ValueError, match="set max_steps"):
        Trainer(model=Classifier(), args=args(tmp_path), train_dataset=Stream(blobs(20))).train()


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    out = Trainer(model=Classifier(), args=args(tmp_path, gradient_accumulation_steps=4, num_train_epochs=1),
                  train_dataset=blobs(128)).train()
    assert out.global_step == 2  # 8 batches of 16, 4 per optimizer step


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_the_automatic_fused_optimizer_gives_the_plain_paths_parameters(tmp_path, optim):
    def run(name, optimizers=(None, None), model=None):
        Trainer(model=model, args=args(tmp_path / name, optim=optim, max_steps=10, lr_scheduler_type="constant",
                                       learning_rate=1e-2), train_dataset=blobs(256), optimizers=optimizers).train()
        return model

    torch.manual_seed(0)
    fast = run("fast", model=Classifier(hidden=32))
    torch.manual_seed(0)
    plain_model = Classifier(hidden=32)
    opt = (torch.optim.SGD(plain_model.parameters(), lr=1e-2, foreach=False) if optim == "sgd" else
           torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.0, foreach=False))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    plain = run("plain", (opt, sched), plain_model)
    trainer_opt = Trainer(model=Classifier(), args=args(tmp_path / "x", optim=optim)).create_optimizer()
    assert trainer_opt.defaults["fused"] is True
    for a, b in zip(fast.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

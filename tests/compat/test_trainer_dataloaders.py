"""The Trainer's dataloaders as transformers' are: torch DataLoaders with Accelerate's attributes,
named eval datasets, persistent workers reused, and any iterable from an overridden method."""

from __future__ import annotations

import math

import pytest
import torch

import mixprec

from toys import SineRegressor as _Regressor
from toys import SineRows as _Rows

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """transformers' Trainer makes an Accelerate Accelerator, whose state is process-global."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _trainer(lib, tmp_path, trainer_cls=None, **more):
    settings = dict(output_dir=str(tmp_path / lib.__name__), num_train_epochs=1, per_device_train_batch_size=4,
                    learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                    use_cpu=True, seed=3, per_device_eval_batch_size=8, train_sampling_strategy="sequential")
    args = lib.TrainingArguments(**{**settings, **more})
    return (trainer_cls or lib.Trainer)(model=_Regressor(), args=args, train_dataset=_Rows(),
                                        eval_dataset={"a": _Rows(), "b": torch.utils.data.Subset(_Rows(), range(8))})


def test_prepared_loaders_are_dataloaders_with_accelerates_attributes(tmp_path):
    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path)
        dl = trainer.get_train_dataloader()
        assert isinstance(dl, torch.utils.data.DataLoader), lib
        assert (dl.total_batch_size, dl.total_dataset_length, len(dl)) == (4, 40, 10), lib
        assert not dl.end_of_dataloader and dl.dataset is not None and hasattr(dl, "set_epoch")
        named = trainer.get_eval_dataloader("b")
        assert isinstance(named, torch.utils.data.DataLoader) and len(named.dataset) == 8 and len(named) == 1, lib
    with pytest.raises(ValueError, match=r"\['a', 'b'\]"):
        _trainer(mixprec, tmp_path).get_eval_dataloader("c")


def test_a_persistent_workers_eval_loader_is_made_once_per_name_and_reused(tmp_path):
    trainer = _trainer(mixprec, tmp_path, dataloader_num_workers=1, dataloader_persistent_workers=True)
    first, again, other = trainer.get_eval_dataloader("a"), trainer.get_eval_dataloader("a"), trainer.get_eval_dataloader("b")
    assert first is again and other is not first
    losses = [trainer.evaluate()["eval_a_loss"] for _ in range(2)]
    assert losses[0] == losses[1] and trainer.get_eval_dataloader("a") is first


class _RowsWithANote(_Rows):
    """:class:`SineRows` with a column the model's forward does not take (``note``)."""

    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "note": i}


def test_each_loaders_dataset_is_the_one_passed_where_no_column_is_dropped_as_in_transformers(tmp_path):
    """``get_train_dataloader().dataset`` (and the eval and test loaders') is the user's dataset
    itself, not a wrapper, under both Trainers."""
    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path)
        train, evaluation, test = _Rows(), _Rows(), _Rows()
        trainer.train_dataset, trainer.eval_dataset = train, evaluation
        assert trainer.get_train_dataloader().dataset is train, lib
        assert trainer.get_eval_dataloader().dataset is evaluation, lib
        assert trainer.get_eval_dataloader(test).dataset is test, lib
        assert trainer.get_test_dataloader(test).dataset is test, lib


@pytest.mark.parametrize("collator", [None, "custom"])
def test_columns_the_forward_does_not_take_are_still_dropped_from_the_batches_as_in_transformers(
        collator, tmp_path, one_thread):
    """A column the model's forward does not name never reaches it (the batch holds the forward's
    columns and the labels), with the default collator and a custom one; the loader's dataset is
    still the user's, as in transformers (whose collator drops them). The run trains."""
    seen = []

    def custom(samples):
        seen.append(sorted(samples[0]))
        return torch.utils.data.default_collate(samples)

    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path, max_steps=2)
        if collator:
            trainer.data_collator = custom
        trainer.train_dataset = trainer.eval_dataset = data = _RowsWithANote()
        for dl in (trainer.get_train_dataloader(), trainer.get_eval_dataloader(), trainer.get_test_dataloader(data)):
            assert dl.dataset is data, lib
            assert sorted(next(iter(dl))) == ["labels", "x"], lib
        assert trainer.train().global_step == 2, lib
    assert not collator or seen and all(keys == ["labels", "x"] for keys in seen)


class _Chain:
    """An iterable of batches from several loaders, one after the other (no DataLoader itself)."""

    def __init__(self, loaders):
        self.loaders = loaders

    def __len__(self):
        return sum(len(dl) for dl in self.loaders)

    def __iter__(self):
        for dl in self.loaders:
            yield from dl


def _chained(lib):
    class Chained(lib.Trainer):
        def get_train_dataloader(self):
            return _Chain([super().get_train_dataloader(), super().get_train_dataloader()])

        def get_eval_dataloader(self, eval_dataset=None):
            return list(super().get_eval_dataloader(eval_dataset))  # a plain list of batches
    return Chained


def test_an_overridden_loader_returning_any_iterable_trains_as_under_transformers(tmp_path, one_thread):
    runs = {}
    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path, _chained(lib), num_train_epochs=2, gradient_accumulation_steps=2)
        trainer.eval_dataset = _Rows()
        trainer.train()
        runs[lib.__name__] = (trainer.state.global_step, trainer.state.log_history, trainer.evaluate()["eval_loss"],
                              {k: v.clone() for k, v in trainer.model.state_dict().items()})
    (their_steps, theirs, their_eval, their_w), (our_steps, ours, our_eval, our_w) = runs.values()
    assert our_steps == their_steps == 20  # 2 epochs of 2 x 10 batches, 2 per step
    assert all(torch.allclose(their_w[k], our_w[k], rtol=1e-5, atol=1e-7) for k in their_w)
    their_losses = [r["loss"] for r in theirs if "loss" in r]
    our_losses = [r["loss"] for r in ours if "loss" in r]
    assert len(our_losses) == len(their_losses) and all(
        math.isclose(a, b, rel_tol=1e-4) for a, b in zip(our_losses, their_losses))
    assert math.isclose(our_eval, their_eval, rel_tol=1e-5)


def test_eval_options_reach_compute_metrics_as_under_transformers(tmp_path, one_thread):
    """include_for_metrics (inputs and per-sample losses), eval_do_concat_batches=False (one array
    per batch) and eval_use_gather_object: what compute_metrics receives is transformers'."""
    seen = {}

    def metrics(lib):
        def compute(p):
            seen[lib.__name__] = p
            return {"n": float(len(p.predictions))}
        return compute

    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path, include_for_metrics=["inputs", "loss"], eval_do_concat_batches=False,
                           eval_use_gather_object=True, per_device_eval_batch_size=16)
        trainer.model.main_input_name = "x"
        trainer.compute_metrics = metrics(lib)
        assert trainer.evaluate("b")["eval_n"] == 1.0
        trainer.evaluate("a")
    theirs, ours = seen["transformers"], seen["mixprec"]
    assert len(tuple(ours)) == len(tuple(theirs)) == 4  # predictions, label_ids, inputs, losses
    assert [a.shape for a in ours.predictions] == [a.shape for a in theirs.predictions] == [(16, 1), (16, 1), (8, 1)]
    for mine, hf in zip(ours.predictions, theirs.predictions):
        assert (abs(mine - hf) < 1e-6).all()
    assert [a.shape for a in ours.inputs] == [a.shape for a in theirs.inputs]
    assert [a.shape for a in ours.losses] == [a.shape for a in theirs.losses] == [(16,), (16,), (8,)]
    assert all((abs(a - b) < 1e-6).all() for a, b in zip(ours.losses, theirs.losses))


def test_accelerator_config_and_debug_reach_the_accelerator(tmp_path):
    trainer = _trainer(mixprec, tmp_path, accelerator_config={"even_batches": False, "gradient_accumulation_kwargs":
                                                              {"sync_each_batch": True}}, debug="underflow_overflow")
    acc = trainer.accelerator
    assert acc.even_batches is False and acc.gradient_state.sync_each_batch is True
    assert trainer.args.accelerator_config["use_seedable_sampler"] is True and acc.diagnostics.trace_overflow


def test_num_steps_in_the_accelerator_config_is_the_accumulation_as_transformers_takes_it(tmp_path):
    """transformers' tests/trainer/test_trainer_accelerator.py: ``gradient_accumulation_kwargs``'
    ``num_steps`` becomes the accumulation where the arguments give none; with both, an error."""
    def config():  # (a fresh dict for each: transformers writes num_steps=1 into the one it is given)
        return {"gradient_accumulation_kwargs": {"num_steps": 2, "sync_each_batch": True}}

    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path, accelerator_config=config())
        assert trainer.args.gradient_accumulation_steps == 2, lib
        assert trainer.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True
    assert trainer.accelerator.gradient_accumulation_steps == 2  # mixprec's Accelerator accumulates
    trainer.create_accelerator_and_postprocess()  # again (model_init, auto_find_batch_size): the count holds
    assert trainer.accelerator.gradient_accumulation_steps == trainer.args.gradient_accumulation_steps == 2
    for lib in (transformers, mixprec):
        with pytest.raises(ValueError, match="`num_steps` is set but `gradient_accumulation_steps` is greater than 1"):
            _trainer(lib, tmp_path, accelerator_config=config(), gradient_accumulation_steps=3)


def test_the_accelerator_config_class_itself_is_refused_as_transformers_refuses_it(tmp_path):
    from transformers.trainer_pt_utils import AcceleratorConfig

    for lib in (transformers, mixprec):
        with pytest.raises(NotImplementedError, match="fully constructed `AcceleratorConfig`"):
            _trainer(lib, tmp_path, accelerator_config=AcceleratorConfig)


def test_gradient_states_plugin_kwargs_hold_what_accelerates_do():
    """Accelerate's ``plugin_kwargs`` are the plugin's ``to_kwargs()``: the fields set away from
    their defaults (transformers' test_accelerator_config_empty reads them)."""
    import accelerate

    for plugin in (None, {"num_steps": 2, "sync_each_batch": True}, {"num_steps": 3, "adjust_scheduler": False}):
        theirs = accelerate.Accelerator(cpu=True, gradient_accumulation_plugin=plugin and
                                        accelerate.utils.GradientAccumulationPlugin(**plugin))
        ours = mixprec.Accelerator(cpu=True, gradient_accumulation_plugin=plugin and
                                   mixprec.GradientAccumulationPlugin(**plugin))
        assert ours.gradient_state.plugin_kwargs == theirs.gradient_state.plugin_kwargs, plugin


def test_a_kubeflow_trainjob_turns_on_transformers_kubeflow_callback(tmp_path, monkeypatch):
    """As transformers' TrainingArguments: with ``KUBEFLOW_TRAINER_SERVER_URL`` set, ``report_to``
    gains ``"kubeflow"`` (once), and the Trainer reports through transformers' KubeflowCallback."""
    from transformers.integrations import KubeflowCallback

    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", "https://example.invalid")
    for report_to in ("none", "tensorboard", ["kubeflow", "tensorboard"]):
        theirs = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=report_to).report_to
        ours = mixprec.TrainingArguments(output_dir=str(tmp_path), report_to=report_to).report_to
        assert sorted(ours) == sorted(theirs) and ours.count("kubeflow") == 1, report_to
    trainer = _trainer(mixprec, tmp_path)
    assert any(isinstance(cb, KubeflowCallback) for cb in trainer.callback_handler.callbacks)
    monkeypatch.setenv("DISABLE_KUBEFLOW_INTEGRATION", "true")
    assert "kubeflow" not in mixprec.TrainingArguments(output_dir=str(tmp_path)).report_to


def test_auto_find_batch_size_retries_smaller_after_out_of_memory(tmp_path, caplog):
    class Hungry(_Regressor):
        def forward(self, x, labels=None):
            if len(x) > 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().forward(x, labels)

    args = mixprec.TrainingArguments(output_dir=str(tmp_path), auto_find_batch_size=True, max_steps=2,
                                     per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
                                     save_strategy="no", use_cpu=True)
    trainer = mixprec.Trainer(model=Hungry(), args=args, train_dataset=_Rows())
    trainer.train()
    assert trainer._train_batch_size == 3 and trainer.state.global_step == 2 and trainer.state.train_batch_size == 3
    assert "out of memory at per-device batch size 4; trying 3" in caplog.text


@pytest.mark.parametrize("data_seed", [None, 11])
def test_a_shuffled_run_sees_transformers_batch_order_every_epoch(data_seed, tmp_path, one_thread):
    """The default train_sampling_strategy="random": each epoch's order is transformers' (its
    seedable sampler: data_seed, else the seed, plus the epoch), so three epochs end on the same
    weights and losses."""
    from test_differential import trainer_run

    runs = [trainer_run(lib.Trainer, lib.TrainingArguments, str(tmp_path / lib.__name__), num_train_epochs=3,
                        train_sampling_strategy="random", data_seed=data_seed, eval_strategy="no")
            for lib in (transformers, mixprec)]
    (theirs, their_w, _), (ours, our_w, _) = runs
    assert all(torch.allclose(their_w[k], our_w[k], rtol=1e-5, atol=1e-7) for k in their_w)
    their_losses, our_losses = ([r["loss"] for r in h if "loss" in r] for h in (theirs, ours))
    assert len(our_losses) == len(their_losses) == 15
    assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(our_losses, their_losses))


def test_log_level_sets_transformers_verbosity_and_the_info_lines_go_through_its_logger(tmp_path):
    """As transformers' own tests read them: a handler on the ``transformers`` logger sees the
    training summary, the evaluation header and the checkpoint line at ``log_level="info"``, and
    none of them at ``log_level="warning"``."""
    import logging

    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    try:
        for lib in (transformers, mixprec):
            with CaptureLogger(hf_logging.get_logger()) as quiet:
                _trainer(lib, tmp_path, log_level="warning", max_steps=3).train()
            assert "Running training" not in quiet.out, lib
            with CaptureLogger(hf_logging.get_logger()) as cl:
                trainer = _trainer(lib, tmp_path, log_level="info", max_steps=3, save_strategy="steps", save_steps=3)
                trainer.train()
                trainer.evaluate()
            assert hf_logging.get_verbosity() == logging.INFO, lib
            lines = cl.out.splitlines()
            start = lines.index("***** Running training *****")
            summary = lines[start:start + 9]
            assert "  Total optimization steps = 3" in summary and "  Num examples = 40" in summary, (lib, summary)
            assert "  Total train batch size (w. parallel, distributed & accumulation) = 4" in summary
            assert "***** Running Evaluation *****" in lines and "  Batch size = 8" in lines, (lib, lines)
            assert any(line.startswith("Saving model checkpoint to") for line in lines), (lib, lines)
    finally:
        hf_logging.set_verbosity(before)
        logging.getLogger("mixprec").setLevel(logging.NOTSET)
    with pytest.raises(ValueError, match="log_level_replica='loud' is not valid"):
        mixprec.TrainingArguments(output_dir="o", log_level_replica="loud")


@pytest.mark.parametrize("greater", [False, True])
def test_best_model_selection_and_rotation_agree_with_transformers(greater, tmp_path, one_thread):
    """Evaluate and save every 2 steps, keep 2 checkpoints, load the best at the end (by the
    eval loss, or its opposite so that the best is an early one): the same checkpoints kept, the
    same best metric, and the same final weights as transformers."""
    from test_differential import trainer_run

    kept, weights, best = {}, {}, {}
    for lib in (transformers, mixprec):
        out = tmp_path / lib.__name__
        history, weights[lib.__name__], _ = trainer_run(
            lib.Trainer, lib.TrainingArguments, str(out), eval_strategy="steps", eval_steps=2, save_strategy="steps",
            save_steps=2, save_total_limit=2, load_best_model_at_end=True, metric_for_best_model="loss",
            greater_is_better=greater)
        kept[lib.__name__] = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
        evals = [r["eval_loss"] for r in history if "eval_loss" in r]
        best[lib.__name__] = (max if greater else min)(evals)
    assert kept["mixprec"] == kept["transformers"] and len(kept["mixprec"]) == 2
    assert math.isclose(best["mixprec"], best["transformers"], rel_tol=1e-6)
    theirs, ours = weights["transformers"], weights["mixprec"]
    assert all(torch.allclose(theirs[k], ours[k], rtol=1e-5, atol=1e-7) for k in theirs)


def test_memory_metrics_are_reported_under_transformers_names(tmp_path):
    """skip_memory_metrics=False: train's metrics (logged) hold init's and train's CPU figures,
    evaluate's and predict's their own, under the names transformers gives them."""
    keys = {}
    for lib in (transformers, mixprec):
        trainer = _trainer(lib, tmp_path, skip_memory_metrics=False, max_steps=2)
        trained = trainer.train().metrics
        evaluated = trainer.evaluate(_Rows())
        predicted = trainer.predict(_Rows()).metrics
        keys[lib.__name__] = ({k for k in trained if "_mem_" in k or k.startswith("before_init")},
                              {k for k in evaluated if "_mem_" in k}, {k for k in predicted if "_mem_" in k})
        logged = trainer.state.log_history[-2] if "eval_loss" in trainer.state.log_history[-1] else \
            trainer.state.log_history[-1]
        assert "train_mem_cpu_alloc_delta" in logged, lib
    assert keys["mixprec"] == keys["transformers"]
    assert keys["mixprec"][0] == {"before_init_mem_cpu", "init_mem_cpu_alloc_delta", "init_mem_cpu_peaked_delta",
                                  "train_mem_cpu_alloc_delta", "train_mem_cpu_peaked_delta"}


class _Sentences(torch.utils.data.Dataset):
    """Token sequences of 2 to 12 tokens; the label is the sequence's first token's parity."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(5)
        self.rows = [torch.randint(1, 50, (int(torch.randint(2, 13, (1,), generator=g)),), generator=g) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i][0] % 2}


def _pad(rows: list[dict]) -> dict:
    ids = torch.nn.utils.rnn.pad_sequence([r["input_ids"] for r in rows], batch_first=True)
    return {"input_ids": ids, "labels": torch.stack([torch.as_tensor(r["labels"]) for r in rows])}


class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(50, 8, padding_idx=0), torch.nn.Linear(8, 2)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids).sum(1) / (input_ids > 0).sum(1, keepdim=True))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_group_by_length_batches_and_trains_as_under_transformers(tmp_path, one_thread):
    """train_sampling_strategy="group_by_length": transformers' LengthGroupedSampler for training
    and evaluation, so two epochs end on transformers' weights and eval loss."""
    results = {}
    for lib in (transformers, mixprec):
        args = lib.TrainingArguments(output_dir=str(tmp_path / lib.__name__), num_train_epochs=2,
                                     per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=0.05,
                                     train_sampling_strategy="group_by_length", logging_steps=1, report_to="none",
                                     disable_tqdm=True, use_cpu=True, seed=3, save_strategy="no",
                                     per_device_eval_batch_size=8)
        trainer = lib.Trainer(model=_Bag(), args=args, train_dataset=_Sentences(), eval_dataset=_Sentences(16),
                              data_collator=_pad)
        trainer.train()
        results[lib.__name__] = (trainer.evaluate()["eval_loss"],
                                 {k: v.clone() for k, v in trainer.model.state_dict().items()})
    (their_eval, theirs), (our_eval, ours) = results.values()
    assert all(torch.allclose(theirs[k], ours[k], rtol=1e-5, atol=1e-7) for k in theirs)
    assert math.isclose(our_eval, their_eval, rel_tol=1e-5)


@pytest.mark.parametrize("strategy", ["batch_rebalance"])
def test_batch_rebalance_trains_as_under_transformers(strategy, tmp_path, one_thread):
    """train_sampling_strategy="batch_rebalance": transformers' BatchRebalanceSampler (micro-batches
    of balanced cost, variable sizes), not sharded again: two epochs end on transformers' weights."""
    weights = {}
    for lib in (transformers, mixprec):
        args = lib.TrainingArguments(output_dir=str(tmp_path / lib.__name__), num_train_epochs=2,
                                     per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=0.05,
                                     train_sampling_strategy=strategy, logging_steps=1, report_to="none",
                                     disable_tqdm=True, use_cpu=True, seed=3, save_strategy="no")
        trainer = lib.Trainer(model=_Bag(), args=args, train_dataset=_Sentences(), data_collator=_pad)
        trainer.train()
        weights[lib.__name__] = ({k: v.clone() for k, v in trainer.model.state_dict().items()},
                                 trainer.state.global_step)
    (theirs, their_steps), (ours, our_steps) = weights.values()
    assert our_steps == their_steps
    assert all(torch.allclose(theirs[k], ours[k], rtol=1e-5, atol=1e-7) for k in theirs)

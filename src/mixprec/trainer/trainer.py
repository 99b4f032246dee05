"""The Trainer tier: the whole loop, built on :class:`~mixprec.Accelerator`.

Code written for the Hugging Face Trainer runs with ``from mixprec import Trainer,
TrainingArguments``. Precision, devices, processes and checkpoints are the Accelerator's; this
file is the loop, evaluation, and the bookkeeping around them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from mixprec.accelerator.accelerator import Accelerator
from mixprec.accelerator.configs import DataLoaderConfiguration, GradientAccumulationPlugin
from mixprec.accelerator.utils import find_executable_batch_size, set_seed
from mixprec.accelerator.wrappers import AcceleratedOptimizer, precision_forward
from mixprec.checkpoint.folder import CheckpointError
from mixprec.checkpoint.lock import RunLock
from mixprec.checkpoint.transformers_rng import set_transformers_rng_state
from mixprec.data import PreparedDataLoader
from mixprec.diagnostics import precision_drift
from mixprec.diagnostics.monitor import DiagnosticsConfig
from mixprec.distributed import groups as D
from mixprec.distributed.preemption import PREEMPTED_EXIT_CODE, Preemption
from mixprec.models import call_model, extract_loss, original_forward
from mixprec.trainer.adapters import checkpoint_adapters, model_to_inspect
from mixprec.trainer.args import TrainingArguments
from mixprec.trainer.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
    clear_flags,
    hf_compatible,
    log,
    restore_states,
)
from mixprec.trainer.checkpoints import (
    checkpoints_to_resume,
    load_checkpoint_weights,
    load_replaced_weights,
    newest_damaged_error,
    resume_problem,
    rotate_checkpoints_of,
    verify_trainer_files,
    write_trainer_checkpoint,
)
from mixprec.trainer.datasets import collate, drop_unused_columns, model_input_names, prepare_dataset
from mixprec.trainer.evaluation import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    evaluation_loop,
    predict_batch,
)
from mixprec.trainer.export import args_bin, save_model_files, write_model_card
from mixprec.trainer.logs import set_verbosity, trainer_logger
from mixprec.trainer.memory import MemoryTracker
from mixprec.trainer.nonfinite import LossSinceLog, SkipRecorder, find_nonfinite_inputs
from mixprec.trainer.reporters import (
    JsonlLoggerCallback,
    PrinterCallback,
    ProgressCallback,
    TensorBoardCallback,
    TrackerCallback,
    format_metrics,
    print_metrics,
    trim_logs_after,
    write_metrics,
)
from mixprec.trainer.schedules import build_optimizer, decay_parameter_names, get_scheduler
from mixprec.trainer.trainer_state import TrainerControl, TrainerState, export_states
from mixprec.trainer.transformers_checkpoints import (
    is_transformers_checkpoint,
    load_transformers_checkpoint,
    loss_total_from_history,
    transformers_rng_files,
)

__all__ = ["Trainer", "TrainOutput", "EvalPrediction", "PredictionOutput", "set_seed"]

class TrainOutput(NamedTuple):
    """What :meth:`Trainer.train` returns."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Trainer:
    """Train, evaluate and checkpoint a model, in mixed precision, in one call.

    Hugging Face's arguments, in Hugging Face's order:

    Args:
        model: a Hugging Face model (keyword batches, ``.loss``) or an ``nn.Module`` returning a
            loss tensor or a dict with ``"loss"``. Trained in place; ``trainer.model`` is it.
        args: :class:`TrainingArguments` (defaults if ``None``).
        data_collator: builds a batch from a list of samples (default: torch's ``default_collate``).
        train_dataset, eval_dataset: torch datasets, lists of dicts, or Hugging Face datasets;
            ``eval_dataset`` may be a dict of them (metrics get each name in their prefix).
        processing_class: the tokenizer or processor (kept, passed to callbacks).
        model_init: builds the model (seeded with ``args.seed`` first); called again by every
            :meth:`train`, so each run starts from scratch.
        compute_loss_func: ``(outputs, labels, num_items_in_batch) -> loss`` instead of the model's loss.
        compute_metrics: ``EvalPrediction -> dict`` of metrics (with ``batch_eval_metrics``, also
            ``compute_result=``: called per batch, the last call's dict is the result).
        callbacks: :class:`TrainerCallback` instances or classes (Hugging Face's work too), after
            the default ones (:class:`DefaultFlowCallback`, then the reporters' ones).
        optimizers: ``(optimizer, scheduler)`` to use instead of the ones ``args`` describe.
        optimizer_cls_and_kwargs: ``(optimizer class, kwargs)`` to build the optimizer with.
        preprocess_logits_for_metrics: ``(logits, labels) -> logits`` applied per batch.

    Example:
        >>> trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", bf16=True),
        ...                   train_dataset=train, eval_dataset=val)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP

    A SIGTERM during ``train()`` (a scheduler's preemption) stops every process after the current
    optimizer step, writes a checkpoint, logs one line and exits with status 75
    (``mixprec.distributed.preemption.PREEMPTED_EXIT_CODE``); ``resume_from_checkpoint=True`` continues bit for bit.
    """

    #: FLOPs counted since the last :meth:`store_flos` (transformers' estimate; 0 for a model without one).
    current_flos: float = 0.0
    _counted_params: int | None = None  # the model's non-embedding parameters, counted for floating_point_ops

    _preemption: Preemption | None = None
    _preempted_at: int | None = None

    #: Whether ``compute_loss`` returns a loss already divided by the accumulation steps (``True``:
    #: used as it is); ``None``/``False``: divided here, as transformers does for a model's own loss.
    loss_is_scaled_for_ga: bool | None = None

    def __init__(self, model: torch.nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, model_init: Any = None, compute_loss_func: Any = None,
                 compute_metrics: Any = None, callbacks: list | None = None, optimizers: tuple[Any, Any] = (None, None),
                 optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
                 preprocess_logits_for_metrics: Any = None) -> None:
        self.args = args if args is not None else TrainingArguments()
        self._memory_tracker = MemoryTracker(not self.args.skip_memory_metrics)  # skip_memory_metrics=False
        self._memory_tracker.start("init")
        if not isinstance(self.args, TrainingArguments):
            raise TypeError(f"args must be mixprec.TrainingArguments, got {type(self.args).__name__}")
        self.args.validate()
        if model is None and model_init is None:
            raise ValueError("Trainer needs a model, or a model_init that builds one")
        if model_init is not None and (optimizers[0] is not None or optimizers[1] is not None):
            raise RuntimeError("model_init builds a new model for every train(), so optimizers=(optimizer, scheduler) "
                               "made for one model cannot be used; subclass Trainer and override create_optimizer / "
                               "create_scheduler instead")
        if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
            raise RuntimeError("pass either optimizers=(optimizer, scheduler) or optimizer_cls_and_kwargs, not both")
        (enable_full_determinism if self.args.full_determinism else set_seed)(self.args.seed)
        self.model_init = model_init
        self._setup_model(model if model is not None else self.call_model_init())
        self.data_collator = data_collator
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.model_accepts_loss_kwargs = False  # the loss is the model's mean: no num_items_in_batch is passed
        self._set_transformers_attributes()
        #: transformers' ``LabelSmoother`` for ``label_smoothing_factor`` (``None`` without smoothing,
        #: and on a multi-label classifier, with transformers' warning).
        self.label_smoother = _label_smoother(self.args.label_smoothing_factor, self.model)
        self._train_batch_size = self.args.train_batch_size  # (auto_find_batch_size lowers it)
        if (self.args.log_level if self.args.should_log else self.args.log_level_replica) != "passive":
            set_verbosity(self.args.get_process_log_level())  # mixprec's logger and transformers', as it does
        names, _ = model_input_names(self.model)
        self.label_names = self.args.label_names or ([n for n in names if "label" in n] or ["labels"])
        # Hugging Face's order: the flow, the reporters, the user's, then the progress display.
        default: list[Any] = [hf_compatible(DefaultFlowCallback)]
        default += [TensorBoardCallback] if "tensorboard" in self.args.reporters else []
        default += [_kubeflow_callback()] if "kubeflow" in self.args.reporters else []
        trackers = sorted(self.args.reporters - {"jsonl", "tensorboard", "kubeflow"})  # through mixprec.tracking
        default += [TrackerCallback(trackers)] if trackers else []
        self._jsonl = JsonlLoggerCallback() if "jsonl" in self.args.reporters else None  # the Trainer's own record
        self.callback_handler = CallbackHandler(default + list(callbacks or []), self.model, processing_class,
                                                self.optimizer, self.lr_scheduler)
        self.add_callback(hf_compatible(PrinterCallback if self.args.disable_tqdm else ProgressCallback))
        self.state = TrainerState(is_world_process_zero=self.accelerator.is_main_process,
                                  is_local_process_zero=self.accelerator.local_process_index == 0,
                                  precision=self.accelerator.policy.name)
        self.control = TrainerControl()
        self._event("on_init_end")
        self._memory_tracker.stop("init")

    def _set_transformers_attributes(self) -> None:
        """transformers' Trainer attributes, with the values they hold on the runs mixprec makes
        (no DeepSpeed, XLA, model parallelism or hyperparameter search: those are off or ``None``)."""
        a, inner = self.args, self.accelerator.unwrap_model(self.model)
        self.is_in_train = False  # True inside train()
        self.hp_name = self.hp_search_backend = self.hub_model_id = self.deepspeed = None
        self.neftune_noise_alpha = a.neftune_noise_alpha
        self.is_deepspeed_enabled = False
        self.is_fsdp_xla_enabled = self.is_fsdp_xla_v1_enabled = self.is_fsdp_xla_v2_enabled = False
        self.is_model_parallel = bool(getattr(inner, "is_parallelizable", False) and getattr(inner, "model_parallel", False))
        self.is_distributed_loading_by_transformers = getattr(inner, "is_distributed_loading_by_transformers", False)
        self.place_model_on_device = True  # prepare() moves the model (FSDP2 shards it in place)
        forward = inspect.signature(type(inner).forward).parameters
        self.can_return_loss = "return_loss" in forward and forward["return_loss"].default is True
        self.current_gradient_accumulation_steps = a.gradient_accumulation_steps

    def create_accelerator_and_postprocess(self) -> None:
        """``self.accelerator``: a fresh :class:`~mixprec.Accelerator` from ``args`` (the precision,
        accumulation, ``accelerator_config``, ``ddp_*``, FSDP2, compilation, diagnostics), as
        transformers' method of that name makes its own."""
        a = self.args
        compile_options = {k: v for k, v in (("backend", a.torch_compile_backend), ("mode", a.torch_compile_mode)) if v}
        settings = a.accelerator_config  # Hugging Face's, as validate() filled it in
        loaders = {k: settings[k] for k in ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler",
                                            "non_blocking")}
        accumulation = dict(settings["gradient_accumulation_kwargs"] or {})
        if "num_steps" in accumulation:  # transformers' rule: the config's count where the arguments give none
            # (a second Accelerator, for model_init or auto_find_batch_size, finds the count taken already)
            if a.gradient_accumulation_steps > 1 and accumulation["num_steps"] != a.gradient_accumulation_steps:
                raise ValueError("The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is "
                                 f"greater than 1 ({a.gradient_accumulation_steps}) in the passed `TrainingArguments`: "
                                 "give one of them (leave gradient_accumulation_steps at 1 to use num_steps)")
            a.gradient_accumulation_steps = int(accumulation.pop("num_steps"))
        self.accelerator = Accelerator(
            mixed_precision=a.resolved_precision, cpu=a.use_cpu, precision_config=a.precision_config,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=a.gradient_accumulation_steps,
                                                                    **accumulation),
            compile=(compile_options or True) if a.torch_compile else False, kwargs_handlers=a.ddp_handlers(),
            # The Trainer resumes mid-epoch from the loader's saved position (it never skips batches itself).
            dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True, data_seed=a.data_seed, **loaders),
            fsdp_plugin=a.fsdp_plugin,  # FSDP2 under torchrun when TrainingArguments(fsdp="full_shard")
            diagnostics=DiagnosticsConfig(gradient_stats_every=a.diagnostics_steps,
                                          trace_overflow=a.trace_overflow or "underflow_overflow" in a.debug,
                                          drift_every=a.drift_steps))
        # transformers sets these here too: a new Accelerator (model_init, auto_find_batch_size)
        # must not leave them on the old one. The evaluation loop gathers through gather_function.
        self.is_fsdp_enabled = self.accelerator.fsdp_plugin is not None
        self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                 use_gather_object=a.eval_use_gather_object)

    def _setup_model(self, model: torch.nn.Module) -> None:
        """A fresh Accelerator from ``args``, with ``model`` prepared on it."""
        self.create_accelerator_and_postprocess()
        self.model = model
        start = time.time()
        self.model_wrapped = self.accelerator.prepare_model(model)
        self._preparation_seconds = round(time.time() - start, 4)  # see _run_evaluation
        checkpoint_adapters(self.accelerator, model, lambda: self.args.save_safetensors)  # a peft model's: the adapter

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """The model ``model_init`` builds."""
        model = self.model_init() if trial is None else self.model_init(trial)
        if model is None:
            raise RuntimeError("model_init returned None; it must return the model to train")
        return model

    # -- callbacks -------------------------------------------------------------------------
    def add_callback(self, callback: TrainerCallback | type) -> None:
        """Add a callback (an instance, or a class to instantiate)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        """Remove and return the first callback of that class (or that instance)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        """Remove the first callback of that class (or that instance)."""
        self.callback_handler.remove_callback(callback)

    def _event(self, name: str, **kwargs: Any) -> TrainerControl:
        h = self.callback_handler
        listening = h.listeners(name)
        if not listening:  # only the flags the event clears: no callback to hand objects to
            return clear_flags(name, self.control)
        h.model, h.optimizer, h.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        self.control = h.call_listeners(name, listening, self.args, self.state, self.control, **kwargs)
        return self.control

    def _load_callback_state(self) -> None:
        """With ``restore_callback_states_from_checkpoint``: rebuild the callbacks (and the control)
        whose state ``state.stateful_callbacks`` holds, matched by class name, in order."""
        if self.args.restore_callback_states_from_checkpoint:
            self.control = restore_states(self.callback_handler.callbacks, self.control,
                                          getattr(self.state, "stateful_callbacks", None) or {})

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the run."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process on its machine."""
        return self.accelerator.local_process_index == 0

    def get_num_trainable_parameters(self) -> int:
        """The number of parameters that require gradients (counted now: freezing changes it)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    # -- data --------------------------------------------------------------------------------
    def _dataloader(self, dataset: Any, batch_size: int, shuffle: bool, checkpoint: bool) -> Any:
        a = self.args
        ds = prepare_dataset(dataset, self.model, remove_unused_columns=a.remove_unused_columns,
                             label_names=self.label_names, custom_collator=self.data_collator is not None)
        collate_fn = drop_unused_columns(self.data_collator or collate, ds, self.model,
                                         remove_unused_columns=a.remove_unused_columns, label_names=self.label_names)
        kwargs: dict[str, Any] = dict(batch_size=batch_size, collate_fn=collate_fn,
                                      num_workers=a.dataloader_num_workers, drop_last=a.dataloader_drop_last)
        if a.dataloader_pin_memory and self.accelerator.device.type == "cuda":
            kwargs["pin_memory"] = True
        if a.dataloader_num_workers > 0:  # torch refuses these without worker processes
            kwargs.update(persistent_workers=a.dataloader_persistent_workers, in_order=a.dataloader_in_order,
                          prefetch_factor=a.dataloader_prefetch_factor,
                          multiprocessing_context=a.dataloader_multiprocessing_context)
        iterable = isinstance(ds, IterableDataset)
        if shuffle and not iterable and a.train_sampling_strategy == "batch_rebalance":
            # transformers' rank-aware batch sampler: each process's own batches, not sharded again
            del kwargs["batch_size"], kwargs["drop_last"]
            kwargs["batch_sampler"] = self._rebalance_sampler(ds)
            return self.accelerator.preparer.prepare_data_loader(DataLoader(ds, **kwargs), checkpoint=checkpoint,
                                                                 presharded=True)
        sampler = self._get_train_sampler(ds) if shuffle else self._get_eval_sampler(ds)  # (a subclass's too)
        if sampler is not None:
            kwargs["sampler"] = sampler
        return self.accelerator.prepare_data_loader(DataLoader(ds, **kwargs), checkpoint=checkpoint)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """The training sampler ``train_sampling_strategy`` names, over ``train_dataset`` (default:
        the Trainer's) as the dataloader reads it; ``None``: the dataset's order. transformers'
        hook: a subclass overrides it to sample otherwise, and the prepared loader shards what it gives."""
        ds = self.train_dataset if train_dataset is None else train_dataset
        if ds is None or isinstance(ds, IterableDataset):
            return None
        a = self.args
        if a.train_sampling_strategy == "group_by_length":
            return self._length_grouped_sampler(ds, self._train_batch_size * a.gradient_accumulation_steps, True)
        if a.train_sampling_strategy == "random":
            # Shuffled by the prepared loader as transformers' is (Accelerate's seedable sampler, the
            # default of accelerator_config): epoch e's order from data_seed (else torch's initial
            # seed, which the Trainer set to seed) + e, the same on every process.
            return RandomSampler(ds)
        return None

    def _get_eval_sampler(self, eval_dataset: Any) -> Any:
        """The evaluation (and prediction) sampler: in order (``None``), or grouped by length with
        ``train_sampling_strategy="group_by_length"``; transformers' hook, as :meth:`_get_train_sampler`."""
        if isinstance(eval_dataset, IterableDataset) or self.args.train_sampling_strategy != "group_by_length":
            return None
        return self._length_grouped_sampler(eval_dataset, self.args.eval_batch_size, False)

    def _length_grouped_sampler(self, ds: Any, megabatch: int, training: bool) -> Any:
        """transformers' ``LengthGroupedSampler`` over ``ds`` (``train_sampling_strategy="group_by_length"``):
        the lengths from ``length_column_name`` of a ``datasets.Dataset``, else from each sample's
        main input; for training shuffled by torch's RNG, for evaluation by ``data_seed`` (else
        ``seed``), as transformers builds them."""
        try:
            from transformers.trainer_pt_utils import LengthGroupedSampler
        except ImportError as e:
            raise ImportError("train_sampling_strategy='group_by_length' uses transformers' LengthGroupedSampler: "
                              "pip install transformers, or use 'random'") from e
        a = self.args
        names = getattr(ds, "column_names", None)
        lengths = ds[a.length_column_name] if names is not None and a.length_column_name in names else None
        main = getattr(self.processing_class, "model_input_names", [None])[0]
        seeded = None if training else torch.Generator().manual_seed(a.data_seed if a.data_seed is not None else a.seed)
        return LengthGroupedSampler(megabatch, dataset=ds, lengths=lengths, model_input_name=main, generator=seeded)

    def _rebalance_sampler(self, ds: Any) -> Any:
        """transformers' ``BatchRebalanceSampler`` (``train_sampling_strategy="batch_rebalance"``):
        per optimizer step, ``train_batch_size x accumulation x processes`` samples split into
        micro-batches of balanced cost (padding and attention), this process's share, as
        transformers builds it."""
        try:
            from transformers.trainer_pt_utils import BatchRebalanceSampler
        except ImportError as e:
            raise ImportError("train_sampling_strategy='batch_rebalance' uses transformers' BatchRebalanceSampler: "
                              "pip install transformers, or use 'group_by_length'") from e
        a, acc = self.args, self.accelerator
        names = getattr(ds, "column_names", None)
        lengths = list(ds[a.length_column_name]) if names is not None and a.length_column_name in names else None
        if lengths is None:
            main = getattr(self.processing_class, "model_input_names", ["input_ids"])[0]
            first = ds[0]
            if not isinstance(first, Mapping) or main not in first:
                raise ValueError(f"train_sampling_strategy='batch_rebalance' reads each sample's length from its "
                                 f"{main!r}: give samples that are dicts with it, or a length_column_name column")
            lengths = [len(ds[i][main]) for i in range(len(ds))]
        ga = a.gradient_accumulation_steps
        return BatchRebalanceSampler(lengths=lengths, effective_batch_size=self._train_batch_size * ga * acc.num_processes,
                                     dp_size=acc.num_processes, grad_accum=ga, rank=acc.process_index,
                                     drop_last=a.dataloader_drop_last)

    def get_train_dataloader(self) -> Any:
        """The training dataloader: shuffled by ``data_seed`` (else ``seed``), batches fetched at once.

        Override it to return any iterable of batches: one that is not a prepared dataloader is
        iterated as it is (not sharded, as in transformers), its batches moved to the device."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._dataloader(self.train_dataset, self._train_batch_size, True, checkpoint=True)

    def get_eval_dataloader(self, eval_dataset: str | Any = None) -> Any:
        """The evaluation dataloader, in order: for ``eval_dataset`` (a dataset, or the name of one
        of a dict of eval datasets), else the Trainer's. With ``dataloader_persistent_workers`` the
        loader is made once per name (``"eval"`` for the Trainer's own) and reused, workers and all."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        cache = self.__dict__.setdefault("_eval_dataloaders", {})
        if self.args.dataloader_persistent_workers and key in cache:
            return cache[key]
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                names = sorted(self.eval_dataset) if isinstance(self.eval_dataset, dict) else []
                raise ValueError(f"eval_dataset={eval_dataset!r} names no eval dataset: the Trainer's eval_dataset "
                                 f"names {names}" if names else "a name needs the Trainer's eval_dataset to be a dict")
            ds = self.eval_dataset[eval_dataset]
        else:
            ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        dl = self._dataloader(ds, self.args.eval_batch_size, False, checkpoint=False)
        if self.args.dataloader_persistent_workers:
            cache[key] = dl
        return dl

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The prediction dataloader for ``test_dataset``, in order."""
        return self._dataloader(test_dataset, self.args.eval_batch_size, False, checkpoint=False)

    def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
        """``dataloader``, starting its next epoch at batch ``num_batches`` (without loading the
        ones before where its sampler allows); what a resume mid-epoch calls (override it for a
        loader that cannot skip so)."""
        return self.accelerator.skip_first_batches(dataloader, num_batches)

    def _loop_loader(self, dl: Any, checkpoint: bool) -> Any:
        """``dl`` as the loops read it: a prepared dataloader as it is, any other iterable wrapped
        (batches moved to the device, the position tracked), as transformers iterates it."""
        if isinstance(dl, PreparedDataLoader):
            return dl
        return self.accelerator.preparer.prepare_iterable(dl, checkpoint=checkpoint)

    # -- optimizer ---------------------------------------------------------------------------
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW (or SGD) as ``args`` say, or ``optimizer_cls_and_kwargs``, over ``model``'s
        parameters (default: the Trainer's model); no weight decay on biases and norm weights
        (1-d tensors). Sets and returns ``self.optimizer``."""
        if self.optimizer is None:
            model = self.model if model is None else model
            self.optimizer = build_optimizer(self.args, model, self.optimizer_cls_and_kwargs,
                                             decay=self.get_decay_parameter_names(model))  # (a subclass's rule too)
        return self.optimizer

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """The parameters weight decay applies to (Hugging Face's rule: not biases, not norms)."""
        return decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: torch.nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
        """The optimizer class and keyword arguments ``args.optim`` and ``args.optim_args`` name
        (transformers' own mapping; it needs transformers installed)."""
        from transformers import Trainer as HFTrainer

        return HFTrainer.get_optimizer_cls_and_kwargs(args, model)

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each of the optimizer's parameter groups."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_optimizer_group(self, param: Any = None) -> Any:
        """The parameter group holding ``param``, or every group's parameters without one."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        if param is not None:
            for group in self.optimizer.param_groups:
                if any(param is p for p in group["params"]):
                    return group
        return [group["params"] for group in self.optimizer.param_groups]

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The ``lr_scheduler_type`` schedule over ``num_training_steps``; sets and returns ``self.lr_scheduler``."""
        if self.lr_scheduler is None:
            self.lr_scheduler = get_scheduler(self.args.lr_scheduler_type, optimizer or self.optimizer,
                                              self.args.warmup_for(num_training_steps), num_training_steps,
                                              scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
            self._created_lr_scheduler = True  # made here: the next train() makes a fresh one (as in HF)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """:meth:`create_optimizer`, then :meth:`create_scheduler`."""
        self.create_scheduler(num_training_steps, self.create_optimizer())

    # -- the loop ----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None) -> TrainOutput:
        """Train; ``resume_from_checkpoint=True`` continues from the newest complete checkpoint in
        ``output_dir`` (or a path), at the exact batch, with the same data order and RNG;
        ``"auto"`` does so if there is one and starts afresh if not. After torchrun's elastic agent
        restarted the run (``TORCHELASTIC_RESTART_COUNT`` > 0), ``None`` means ``"auto"``.
        ``ignore_keys_for_eval``: output keys the evaluations during training leave out."""
        if trial is not None:
            raise ValueError("trial: hyperparameter search is not supported by mixprec's Trainer")
        self._ignore_keys_for_eval = ignore_keys_for_eval
        self.args.validate()
        self._memory_tracker.start("train")
        neftune = _activate_neftune(self.model, self.neftune_noise_alpha, self.accelerator)
        self.is_in_train = True
        try:
            with self._output_dir_lock():
                if self.args.auto_find_batch_size:
                    result = find_executable_batch_size(self._train_with_batch_size, self.args.train_batch_size)(
                        resume_from_checkpoint)
                else:
                    result = self._train(resume_from_checkpoint)
        finally:
            self._memory_tracker.stop("train")  # (measured into the metrics already, unless it failed)
            self.is_in_train = False
            if neftune is not None:  # the noise is for training only
                neftune.remove()
        if self._preempted_at is not None:
            raise SystemExit(PREEMPTED_EXIT_CODE)
        return result

    def _train_with_batch_size(self, batch_size: int, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        """:meth:`_train` with ``batch_size`` samples per batch (``auto_find_batch_size``: called
        again with a smaller one after an out-of-memory error, from a fresh Accelerator)."""
        if self._train_batch_size != batch_size:
            log.warning("mixprec: out of memory at per-device batch size %d; trying %d (auto_find_batch_size)",
                        self._train_batch_size, batch_size)
            self._setup_model(self.accelerator.unwrap_model(self.model))
            if self._created_optimizer:
                self.optimizer = None
        self._train_batch_size = batch_size
        self._created_optimizer = self.optimizer is None
        return self._train(resume_from_checkpoint)

    @contextlib.contextmanager
    def _output_dir_lock(self) -> Generator[None, None, None]:
        """Refuse, before the first step, an output_dir that cannot be written or that a live run
        uses (the main process holds the lock; every process gets its verdict)."""
        lock = RunLock(self.args.output_dir) if self.accelerator.is_main_process else contextlib.nullcontext()
        error = None
        try:
            lock.__enter__()
        except RuntimeError as e:
            error = str(e)
        error = D.broadcast_object(error)
        if error is not None:
            raise RuntimeError(error)
        try:
            yield
        finally:
            lock.__exit__(None, None, None)

    def _load_checkpoint(self, candidates: list[Path], resume: str | bool, restarted: int) -> Path | None:
        """Restore the first of ``candidates`` that verifies and return it. ``"auto"`` skips a damaged
        one with a warning naming it and why (``None`` if none verifies: the run starts over);
        otherwise a damaged checkpoint raises, ``True``'s naming the newest that verifies. A folder
        transformers' Trainer wrote has no manifest to verify: it is read as tensors only
        (:func:`load_transformers_checkpoint`), and ``self._transformers_resume`` holds its random
        state (``{}`` without one) until the loop starts. In a mixprec checkpoint whose weights were
        saved again in another Hugging Face layout, those are read in the same way, with a warning,
        and every other file is verified (:func:`load_replaced_weights`)."""
        acc = self.accelerator
        self._transformers_resume: dict[str, Any] | None = None
        for path in candidates:
            if is_transformers_checkpoint(path):
                rng = load_transformers_checkpoint(path, accelerator=acc, model=self.model, optimizer=self.optimizer,
                                                   lr_scheduler=self.lr_scheduler)
                self._transformers_resume = rng if rng is not None else {}
                return path
            if not any((path / name).exists() for name in ("optimizer_0.bin", "optimizer.pt", "model_0")):
                raise ValueError(f"{path} holds the model's weights only (written with save_only_model=True): a run "
                                 "cannot resume from it; load the weights (from_pretrained, or a Trainer's "
                                 "load_best_model_at_end) and start a new run, or save with save_only_model=False")
            try:
                problem = resume_problem(path) if resume == "auto" else None
                if problem is None:
                    acc.load_state(path)
                    verify_trainer_files(path)
                    # Weights the user saved again in another Hugging Face layout: theirs, as transformers reads them.
                    load_replaced_weights(acc.unwrap_model(self.model, keep_torch_compile=False), path, acc.device)
                    if restarted > 0:
                        log.warning("mixprec: restart %d of this run (torchrun); resuming from %s", restarted, path)
                    return path
            except CheckpointError as e:
                if resume is True:
                    raise newest_damaged_error(Path(self.args.output_dir), path, str(e)) from None
                if resume != "auto":
                    raise
                problem = str(e)
            log.warning("mixprec: skipping the checkpoint %s (resume_from_checkpoint='auto'): %s", path, problem)
        log.warning("mixprec: no checkpoint in %s verifies (%d skipped): starting over", self.args.output_dir,
                    len(candidates))
        return None

    def _train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        """:meth:`train`'s set-up, loop and summary (inside the output folder's lock)."""
        args = self.args
        args.validate()  # fields may have been assigned since the Trainer was made
        if self.model_init is not None:  # every run starts from a fresh model, as in Hugging Face
            (enable_full_determinism if args.full_determinism else set_seed)(args.seed)
            self._setup_model(self.call_model_init())
            self.optimizer = self.lr_scheduler = None
        acc = self.accelerator
        if args.should_checkpoint_activations:
            self._enable_activation_checkpointing()
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if resume is None and restarted > 0:
            resume = "auto"  # torchrun's elastic agent restarted the group: continue, don't start over
        candidates = checkpoints_to_resume(Path(args.output_dir), resume) if resume else []
        if restarted > 0 and resume == "auto" and not candidates:
            log.warning("mixprec: restart %d of this run (torchrun); no checkpoint yet: starting over", restarted)
        train_dl = self._loop_loader(self.get_train_dataloader(), checkpoint=True)
        num_epochs, update_steps, examples, *_, max_steps = self.set_initial_training_values(args, train_dl)
        self._batches_per_epoch = _length(train_dl)
        # (an IterableDataset without __len__: no epochs to count)
        per_epoch = update_steps if self._batches_per_epoch is not None else None
        if getattr(self, "_created_lr_scheduler", False):  # a second train() schedules its own steps
            self.lr_scheduler, self._created_lr_scheduler = None, False
        self.create_optimizer_and_scheduler(max_steps)
        self.optimizer = acc.prepare(self.optimizer)
        # The schedule counts optimizer steps, on every process alike (not Accelerate's one per process).
        self.lr_scheduler = acc.prepare_scheduler(self.lr_scheduler, steps_per_call=1)
        model = self.model_wrapped  # compiled by the Accelerator when torch_compile=True
        self.state = TrainerState(max_steps=max_steps, num_train_epochs=num_epochs,
                                  train_batch_size=self._train_batch_size, is_world_process_zero=acc.is_main_process,
                                  is_local_process_zero=acc.local_process_index == 0, precision=acc.policy.name)
        self.state.compute_steps(args, max_steps)
        self._transformers_resume = None
        resume_path = self._load_checkpoint(candidates, resume, restarted) if candidates else None
        if resume_path is not None:
            saved = TrainerState.load_from_json(resume_path / "trainer_state.json")
            # The run continues as saved, but for as long as *these* arguments say (as in Hugging Face).
            saved.max_steps, saved.num_train_epochs = max_steps, num_epochs
            saved.compute_steps(args, max_steps)
            if saved.best_model_checkpoint is not None and not Path(saved.best_model_checkpoint).is_dir():
                log.warning("mixprec: the best checkpoint %s recorded in the resumed state does not exist anymore; "
                            "ignoring it for this run", saved.best_model_checkpoint)
                saved.best_model_checkpoint = None
            self.state = saved
            if self._transformers_resume is not None:
                self._continue_transformers_run(train_dl, per_epoch)
            if args.ignore_data_skip:  # as transformers: the data starts over; the steps and schedule go on
                train_dl.set_epoch(0)
                train_dl.skip_batches(0)
            elif train_dl.batches_to_skip:  # the epoch's trained batches, skipped by get_resumed_dataloader
                self._resumed_loader(train_dl)
            self._load_callback_state()
            if acc.is_main_process:  # the steps after the checkpoint are replayed: log each once
                trim_logs_after(args.output_dir, saved.global_step)
                for cb in self.callback_handler.callbacks:
                    if isinstance(cb, TensorBoardCallback):
                        cb.purge_step = saved.global_step + 1
        self._loss_since_log = LossSinceLog(torch.tensor(self.state.loss_since_log, device=acc.device),
                                            nan_inf_filter=args.logging_nan_inf_filter)
        self._steps_since_log = self.state.steps_since_log
        self._skips = SkipRecorder(self.state.skipped_steps_since_log)  # read once per log
        self._step_batches: list[tuple[int, int, Any]] = []  # this step's micro-batches, for a skip's report
        self._micro_in_step = 0
        self._preempted_at: int | None = None
        self._done = {"log": -1, "evaluate": -1, "save": -1}
        self._precision_reported = False  # the run's first log says what precision is really in force
        self._grad_norm = None
        self._learning_rate = 0.0  # the rate the last optimizer step used (logged)
        self._counted_params = None  # (a model_init builds a new model each train())
        self._tokens_since_log: Any = 0  # input tokens counted on the device since the last log
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]  # listed once, not per step
        # Decided once, not per step: whether the schedule steps with the evaluation metric, and
        # whether floating_point_ops can count anything (overridden, or a model that counts its parameters).
        self._metric_schedule = self._metric_driven_schedule()
        self._counts_flos = (type(self).floating_point_ops is not Trainer.floating_point_ops
                             or hasattr(self.model, "num_parameters"))
        # transformers' arguments of _maybe_log_save_evaluate: the loss since the last log is read
        # (folded on the device) at each step only for a subclass's override, which may use it.
        self._passes_loss = type(self)._maybe_log_save_evaluate is not Trainer._maybe_log_save_evaluate
        start_time = self._train_start_time = time.time()
        self._log_training_summary(train_dl, resume_path, examples, update_steps)
        self.callback_handler.train_dataloader = train_dl
        self._event("on_train_begin")
        if args.eval_on_start:
            self.evaluate(ignore_keys=self._ignore_keys_for_eval)
        if self._transformers_resume:  # where transformers sets it: as the first resumed batch is trained on
            set_transformers_rng_state(self._transformers_resume, distributed=acc.num_processes > 1)
        epochs = range(train_dl.epoch, num_epochs) if self.state.global_step < max_steps else range(0)
        with Preemption() as self._preemption:
            self._epochs(model, train_dl, epochs, max_steps)
        return self._finish(start_time)

    def _resumed_loader(self, train_dl: Any) -> None:
        """Let :meth:`get_resumed_dataloader` skip the batches the resumed epoch trained on (its
        default sets the loader's skip, as restored; an override may restore its loader's own
        state instead and skip nothing)."""
        n = train_dl.batches_to_skip
        train_dl.skip_batches(0)
        if self.get_resumed_dataloader(train_dl, n) is not train_dl:
            raise ValueError("get_resumed_dataloader() must return the dataloader it was given, positioned (with "
                             "accelerator.skip_first_batches, or by restoring its own state): mixprec's loop keeps "
                             "that one loader, whose position its checkpoints save")

    def _log_training_summary(self, train_dl: Any, resume_path: Path | None, examples: int, per_epoch: int) -> None:
        """transformers' "***** Running training *****" lines (at INFO: ``log_level="info"``), with
        :meth:`set_initial_training_values`' number of examples and of update steps per epoch."""
        a, s = self.args, self.state
        lines = ["***** Running training *****", f"  Num examples = {examples:,}",
                 f"  Num Epochs = {s.num_train_epochs:,}", f"  Num update steps per epoch = {per_epoch:,}"]
        lines += [f"  Instantaneous batch size per device = {a.per_device_train_batch_size:,}"]
        if self._train_batch_size != a.per_device_train_batch_size:
            lines.append(f"  Batch size adjusted to: {self._train_batch_size:,} (auto_find_batch_size)")
        lines += [f"  Total train batch size (w. parallel, distributed & accumulation) = "
                  f"{self.get_total_train_batch_size(a):,}",
                  f"  Gradient Accumulation steps = {a.gradient_accumulation_steps}",
                  f"  Total optimization steps = {s.max_steps:,}",
                  f"  Number of trainable parameters = {self.get_num_trainable_parameters():,}"]
        if resume_path is not None:
            lines.append(f"  Continuing training from checkpoint {resume_path}, at epoch {train_dl.epoch} and "
                         f"global step {s.global_step}")
        hf_log = trainer_logger()
        for line in lines:
            hf_log.info(line)

    def _continue_transformers_run(self, train_dl: Any, per_epoch: int | None) -> None:
        """After a resume from a checkpoint transformers' Trainer wrote (``self.state`` is its
        ``trainer_state.json``): skip the batches it trained on, as it does (the first
        ``global_step // per_epoch`` epochs, then ``global_step % per_epoch`` optimizer steps' worth
        of batches of the next), and set what mixprec's own checkpoints would have restored."""
        s, acc, ga = self.state, self.accelerator, self.args.gradient_accumulation_steps
        epoch, steps = divmod(s.global_step, per_epoch) if per_epoch else (0, s.global_step)
        position = train_dl.state_dict()  # the loader's own format: the epoch, and the batches already yielded
        position.update(epoch=epoch, batches_yielded=steps * ga)
        train_dl.load_state_dict(position)
        acc.step, acc.optimizer_steps = steps * ga, s.global_step  # accumulate()'s count within the epoch
        s.precision = acc.policy.name  # (no mixprec state: nothing fell back)
        s.total_loss = loss_total_from_history(s.log_history, s.global_step)  # train_loss averages every step
        log.info("mixprec: continuing a transformers run at step %d: epoch %d, skipping its first %d batches",
                 s.global_step, epoch, steps * ga)

    def _epochs(self, model: torch.nn.Module, train_dl: Any, epochs: range, max_steps: int) -> None:
        acc = self.accelerator
        for epoch in epochs:
            train_dl.set_epoch(epoch)
            self._event("on_epoch_begin")
            for batch in train_dl:
                with acc.accumulate(model):
                    self._train_one(model, batch, epoch, train_dl)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            if self._preempted_at is not None:  # stop as saved: no epoch-end evaluation after the checkpoint
                break
            self._event("on_epoch_end")
            self._log_save_evaluate(model)
            if self.control.should_training_stop or self.state.global_step >= max_steps:
                break

    def _enable_activation_checkpointing(self) -> None:
        inner = self.accelerator.unwrap_model(self.model)
        a = self.args
        kwargs = a.activation_checkpointing_kwargs or a.gradient_checkpointing_kwargs
        if hasattr(inner, "activation_checkpointing_enable"):  # transformers >= 5's name
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        elif hasattr(inner, "gradient_checkpointing_enable"):
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            raise ValueError(f"gradient_checkpointing=True needs a model with gradient_checkpointing_enable() (a "
                             f"Hugging Face PreTrainedModel); {type(inner).__name__} has none: wrap its blocks in "
                             "torch.utils.checkpoint.checkpoint yourself and leave gradient_checkpointing off")

    def _train_one(self, model: torch.nn.Module, batch: Any, epoch: int, train_dl: Any) -> bool:
        """One micro-batch; returns whether it ended with an optimizer step."""
        acc, args = self.accelerator, self.args
        if self._micro_in_step == 0:
            self._event("on_step_begin")
            if args.drift_steps and self.state.global_step % args.drift_steps == 0:
                self._log_drift(model, batch)
        loss = self.training_step(model, batch)
        if not self.loss_is_scaled_for_ga and args.gradient_accumulation_steps > 1:
            loss = loss / args.gradient_accumulation_steps
        self._step_batches.append((epoch, train_dl.batches_yielded - 1, batch))
        if self._counts_flos:
            self.current_flos += float(self.floating_point_ops(batch))
        if args.include_num_input_tokens_seen != "no":
            self._tokens_since_log = self._tokens_since_log + self._input_tokens(batch)
        # (with Hugging Face's filter, logging_nan_inf_filter: folded on the device every few steps)
        self._loss_since_log.add(loss, self._steps_since_log)
        self._micro_in_step += 1
        if not acc.sync_gradients:
            self._event("on_substep_end")
            return False
        self._micro_in_step = 0
        # The step a reader can hold in their head: (scaled backward done) -> unscale + clip -> step or
        # skip (inside optimizer.step) -> schedule (only if applied) -> zero.
        if args.max_grad_norm:
            self._grad_norm = acc.clip_grad_norm_(self._trainable, args.max_grad_norm)
        self._event("on_pre_optimizer_step")
        self.optimizer.step()
        self._event("on_optimizer_step")
        self._learning_rate = self._get_learning_rate()  # the rate this step used: the one logged
        if not self._metric_schedule:  # those step with the evaluation metric (_maybe_log_save_evaluate)
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        if args.torch_empty_cache_steps and self.state.global_step % args.torch_empty_cache_steps == 0:
            _empty_device_cache(acc.device)
        self._steps_since_log += 1
        self._note_skip(train_dl)
        self.state.epoch = epoch + (train_dl.batches_yielded / self._batches_per_epoch if self._batches_per_epoch else 0)
        self._event("on_step_end")
        if self.state.global_step >= self.state.max_steps:  # stops even without DefaultFlowCallback
            self.control.should_training_stop = True
        if self._preemption is not None and self._preemption.requested():  # SIGTERM: every rank, this step
            self.control.should_save = self.control.should_training_stop = True
            self._preempted_at = self.state.global_step
        self._log_save_evaluate(model)
        if self._preempted_at == self.state.global_step:
            log.warning("mixprec: SIGTERM received; stopped after step %d with a checkpoint in %s; exiting with "
                        "status %d (continue with resume_from_checkpoint=True)", self.state.global_step,
                        self.args.output_dir, PREEMPTED_EXIT_CODE)
        return True

    def _note_skip(self, train_dl: Any) -> None:
        """Record whether this step was skipped (read at the next log); if the host knows it was (the
        schedule read the flag), look for inf/NaN in the step's input batches and say where they are."""
        flag, batches, self._step_batches = self.optimizer.skip_flag, self._step_batches, []
        if flag is not False:  # (nothing to record for a step known to be applied)
            self._skips.record(self.state.global_step, flag)
        if flag is True:
            for bad in find_nonfinite_inputs(batches, train_dl):
                log.warning("mixprec: step %d was skipped: its input batch holds inf/NaN: %s", self.state.global_step, bad)

    def _log_drift(self, model: torch.nn.Module, batch: Any) -> None:
        """This batch's loss in fp32 beside the run's precision: what the lower precision costs."""
        inner = self.accelerator.unwrap_model(model)
        forward = original_forward(inner)

        def loss_of(m: torch.nn.Module, b: Any) -> torch.Tensor:
            # The model's own forward (not the precision's), so the fp32 pass really is fp32.
            return extract_loss(call_model(original_forward(m) if m is not inner else forward, b, inner))

        d = precision_drift(inner, batch, loss_of, self.accelerator.autocast)
        self.log({"drift_loss_fp32": d["loss_fp32"], "drift_loss_mixed": d["loss_mixed"], "drift_rel": d["rel_diff"]})

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward, loss, backward (scaled where the policy needs it); returns the detached loss.

        ``num_items_in_batch`` (transformers' argument, which a subclass may pass on to ``super()``)
        goes to :meth:`compute_loss` where given; mixprec's loop passes none (the loss is the
        model's own mean, see the README's differences)."""
        if not model.training:  # train() walks every module: not on every step
            model.train()
        if self._optimizer_has_modes():  # schedule-free optimizers have modes, as HF calls them
            self.optimizer.train()
        # (only where given: a compute_loss overridden before transformers added the argument has none)
        loss = self.compute_loss(model, inputs) if num_items_in_batch is None else \
            self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.loss_is_scaled_for_ga:  # compute_loss divided it by the accumulation steps already
            self.accelerator.precision.backward(loss)
        else:
            self.accelerator.backward(loss)
        return loss.detach().float()

    def _forward_for_loss(self, model: torch.nn.Module, inputs: Any) -> Any:
        """``model``'s outputs on ``inputs`` as its forward computed them, unconverted by the
        precision (in bf16 or fp16: not cast to fp32), for a caller that keeps only the loss."""
        known = self.__dict__.get("_forward_of")
        if known is None or known[0] is not model:
            known = self._forward_of = (model, precision_forward(model))
        forward = known[1]
        if forward is None or not forward.converts_output:  # (not prepared; or a nested call: left as it is)
            return call_model(model, inputs, self.model)
        forward.converts_output = False
        try:
            return call_model(model, inputs, self.model)
        finally:
            forward.converts_output = True

    def _optimizer_has_modes(self) -> bool:
        """Whether the optimizer has train/eval modes (schedule-free), decided once per optimizer."""
        opt = self.optimizer
        known = self.__dict__.get("_modes_of")
        if known is None or known[0] is not opt:
            inner = opt.optimizer if isinstance(opt, AcceleratedOptimizer) else opt
            known = self._modes_of = (opt, callable(getattr(inner, "train", None)))
        return known[1]

    def compute_loss(self, model: torch.nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The model's loss on ``inputs`` (override for a custom loss; or pass ``compute_loss_func``);
        with ``label_smoothing_factor``, transformers' ``LabelSmoother`` on the logits (the labels
        shifted for a causal language model), as transformers computes it."""
        smoother = self.label_smoother
        if (self.compute_loss_func is not None or smoother is not None) and isinstance(inputs, Mapping) \
                and "labels" in inputs:
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            outputs = call_model(model, inputs, self.model)
            if self.compute_loss_func is not None:
                loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
            else:
                loss = smoother(outputs, labels, shift_labels=_is_causal_lm(self.accelerator.unwrap_model(model)))
            return (loss, outputs) if return_outputs else loss
        outputs = call_model(model, inputs, self.model) if return_outputs else self._forward_for_loss(model, inputs)
        loss = extract_loss(outputs)
        if loss is not None and not return_outputs:  # only the loss is kept: it alone is converted (fp32 in mixed)
            loss = self.accelerator.precision.convert_output(loss)
        if loss is None:
            have = ", ".join(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
            missing = [k for k in self.label_names if not (isinstance(inputs, Mapping) and k in inputs)]
            raise ValueError(
                f"the model returned no loss. The batch has {have}"
                + (f" but no label column {', '.join(map(repr, missing))}" if missing else "")
                + "; add the labels to the dataset (or name them with label_names), make the model return a "
                "loss, or override Trainer.compute_loss")
        return (loss, outputs) if return_outputs else loss

    # -- the learning rate ------------------------------------------------------------------
    def _metric_driven_schedule(self) -> bool:
        """Whether the schedule steps with the evaluation metric (``ReduceLROnPlateau``, the greedy
        schedule), as Hugging Face's Trainer steps them: at each evaluation, never after a step."""
        inner = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        return isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau) or type(inner).__name__ == "GreedyLR"

    def _metric_for_schedule(self, metrics: dict[str, float]) -> float:
        key = self.args.metric_for_best_model or "loss"
        key = key if key.startswith("eval_") else f"eval_{key}"
        if key not in metrics:
            raise KeyError(f"the schedule steps with metric_for_best_model {key!r}, which the evaluation did not "
                           f"return; it returned {sorted(metrics)}")
        return metrics[key]

    def _get_learning_rate(self) -> float:
        """The learning rate of the first parameter group now (Hugging Face's ``_get_learning_rate``)."""
        metric_schedule = getattr(self, "_metric_schedule", None)  # decided at train()
        if metric_schedule if metric_schedule is not None else self._metric_driven_schedule():
            lr = self.optimizer.param_groups[0]["lr"]
        else:
            lr = self.lr_scheduler.get_last_lr()[0]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)

    # -- log / evaluate / save ------------------------------------------------------------
    def _log_save_evaluate(self, model: torch.nn.Module) -> None:
        """:meth:`_maybe_log_save_evaluate` with transformers' arguments, after a step or an epoch."""
        self._maybe_log_save_evaluate(self._loss_since_log.total() if self._passes_loss else None, self._grad_norm,
                                      model, None, self.state.epoch, self._ignore_keys_for_eval,
                                      self._train_start_time, learning_rate=self._learning_rate)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor | None = None, grad_norm: Any = None,
                                 model: torch.nn.Module | None = None, trial: Any = None, epoch: float | None = None,
                                 ignore_keys_for_eval: list[str] | None = None, start_time: float | None = None,
                                 learning_rate: float | None = None) -> None:
        """Log, evaluate and save as the control says (the DefaultFlowCallback decides, Hugging Face's way).

        The arguments are transformers' (a subclass that overrides this passes them on to ``super()``):
        the loss summed since the last log (``None`` unless a subclass overrides this method), the
        last gradient norm, the model, no trial, the epoch, the evaluation's ``ignore_keys``, the
        training's start and the last step's learning rate. What is logged is read from the Trainer
        itself, as transformers' own reads its values."""
        s, c = self.state, self.control
        if c.should_log and self._done["log"] != s.global_step and self._steps_since_log:
            self.store_flos()
            self._log_training()
        metrics = None
        if c.should_evaluate and self._done["evaluate"] != s.global_step and self.eval_dataset is not None:
            metrics = self._evaluate(trial, ignore_keys_for_eval if ignore_keys_for_eval is not None
                                     else getattr(self, "_ignore_keys_for_eval", None))
            self._done["evaluate"] = s.global_step
        improved = self._determine_best_metric(metrics, trial) if metrics is not None else False
        if metrics is not None and self.args.save_strategy == "best":
            c.should_save = improved
        if c.should_save and self._done["save"] != s.global_step:
            try:
                self._save_checkpoint(model, trial)
            except OSError as e:  # nothing was left behind; the previous checkpoint is complete
                if self.args.on_save_error == "raise" or self._preempted_at is not None:
                    raise
                log.warning("mixprec: %s; training goes on to the next save (on_save_error='warn')", e)
            self._done["save"] = s.global_step

    def _log_training(self) -> None:
        acc, s = self.accelerator, self.state
        loss = acc.reduce(self._loss_since_log.total(), "mean").item() / self._steps_since_log
        s.total_loss += loss * self._steps_since_log
        logs: dict[str, Any] = {"loss": round(loss, 6)}
        if self._grad_norm is not None:
            logs["grad_norm"] = float(self._grad_norm)
        logs["learning_rate"] = self._learning_rate
        self._flush_tokens()  # (log() adds the count: a log is every process's here, a collective point)
        logs.update(self._read_scaler_into_state())
        if "skipped_steps" in logs:  # a precision that checks for inf/NaN: which steps it skipped
            logs["skipped_steps_at"] = self._skips.take()
        if acc.monitor is not None:
            logs.update(acc.monitor.log_values())
        if not self._precision_reported:
            self._precision_reported = True
            report = acc.precision_report()  # observed in the steps so far, against the contract
            if not any("precision_in_force" in row for row in s.log_history):  # once per run, resumes included
                logs["precision_in_force"] = report.line()
            if not report.ok and acc.is_main_process:
                log.warning("mixprec: %s", report.line())
        if s.precision != acc.policy.name:  # a loss-scale collapse made the run fall back
            s.precision = logs["precision"] = acc.policy.name
        self._loss_since_log.reset()
        self._steps_since_log = 0
        self._done["log"] = s.global_step
        self.log(logs)

    def _read_scaler_into_state(self) -> dict[str, Any]:
        """Copy the loss scaler's skip count and scale into ``state`` (syncs); returns them for a log."""
        values = self.accelerator.precision.log_values()  # empty where the precision has no scaler
        self.state.loss_scale = values.get("loss_scale", self.state.loss_scale)
        self.state.skipped_steps = values.get("skipped_steps", self.state.skipped_steps)
        return values

    def log(self, logs: dict[str, Any], start_time: float | None = None) -> None:
        """Record ``logs`` in ``state.log_history`` (with ``epoch`` and ``step``), append them to
        ``metrics.jsonl`` (``report_to="jsonl"``) and hand them to the callbacks (``on_log``)."""
        # In place, as transformers' log: the metrics evaluate() returns carry the epoch too.
        logs["epoch"] = round(self.state.epoch, 4)
        if self.args.include_num_input_tokens_seen != "no":  # as counted at the last training log
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        if self._jsonl is not None:
            self._jsonl.on_log(self.args, self.state, self.control, logs=dict(logs))
        self._event("on_log", logs=dict(logs))

    def _metric_key(self) -> str:
        name = self.args.metric_for_best_model
        return name if name.startswith("eval_") else f"eval_{name}"

    def _evaluate(self, trial: Any = None, ignore_keys_for_eval: list[str] | None = None,
                  skip_scheduler: bool = False) -> dict[str, float]:
        """:meth:`evaluate` inside training, then a schedule that steps with the metric
        (``reduce_lr_on_plateau``) takes it unless ``skip_scheduler``; returns the metrics
        (transformers' hook)."""
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        if not skip_scheduler and self._metric_driven_schedule():
            self.lr_scheduler.step(self._metric_for_schedule(metrics))
        return metrics

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any = None) -> bool:
        """Whether ``metrics`` hold a new best ``metric_for_best_model`` (then ``state.best_metric``
        and ``best_global_step`` say so; transformers' hook)."""
        if self.args.metric_for_best_model is None:
            return False
        key = self._metric_key()
        if key not in metrics:
            raise ValueError(f"metric_for_best_model={self.args.metric_for_best_model!r}: evaluation produced no "
                             f"{key!r}; it produced {', '.join(sorted(metrics))}. Use one of those names (without "
                             "the 'eval_' prefix), or return it from compute_metrics")
        value, best = metrics[key], self.state.best_metric
        better = best is None or (value > best if self.args.greater_is_better else value < best)
        if better:
            self.state.best_metric = value
            if self.args.save_strategy != "no":  # (transformers': the step whose checkpoint is the best)
                self.state.best_global_step = self.state.global_step
        return better

    def _get_output_dir(self, trial: Any = None) -> str:
        """Where checkpoints go: ``output_dir`` (no hyperparameter search here, so no trial folder)."""
        return str(self.args.output_dir)

    def _prepare_input(self, data: Any) -> Any:
        """``data`` (a tensor, or a dict, list or tuple of them) on the device, as transformers'
        hook gives it to a subclass's ``compute_loss`` / ``prediction_step``."""
        if isinstance(data, Mapping):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, (tuple, list)):
            return type(data)(self._prepare_input(v) for v in data)
        return data.to(self.accelerator.device) if isinstance(data, torch.Tensor) else data

    def _prepare_inputs(self, inputs: Any) -> Any:
        """:meth:`_prepare_input` of a batch, which must not be empty (the error names the fix)."""
        inputs = self._prepare_input(inputs)
        if len(inputs) == 0:
            raise ValueError("The batch received was empty, your model won't be able to train on it: check that the "
                             f"training dataset holds keys the model takes ({', '.join(self.label_names)} and its "
                             "inputs), or set remove_unused_columns=False")
        return inputs

    def _save_checkpoint(self, model: torch.nn.Module | None = None, trial: Any = None) -> Path:
        """Write ``checkpoint-<global_step>`` (atomically, with its manifest), the best one if this
        step's evaluation set the best metric; rotate; ``on_save``. ``model`` and ``trial`` are
        transformers' arguments (the Trainer's model is saved; there is no trial)."""
        out = Path(self._get_output_dir(trial))
        path = out / f"checkpoint-{self.state.global_step}"
        if self.state.best_global_step == self.state.global_step:
            self.state.best_model_checkpoint = str(path)
        self._read_scaler_into_state()
        self.store_flos()
        self._flush_tokens()
        self.state.loss_since_log = float(self._loss_since_log.total())
        self.state.steps_since_log = self._steps_since_log
        self.state.skipped_steps_since_log = self._skips.steps()
        self.state.stateful_callbacks = export_states([*self.callback_handler.callbacks, self.control])
        files = {"trainer_state.json": self.state.to_json_string(),
                 "mixprec_trainer_state.json": self.state.mixprec_json_string(),
                 "training_args.json": self.args.to_json_string()}
        if pickled := args_bin(self.args):
            files["training_args.bin"] = pickled
        only_model = self.args.save_only_model
        if not only_model:
            files.update(transformers_rng_files(self.accelerator.process_index, self.accelerator.num_processes))
        write_trainer_checkpoint(self.accelerator, path, self.accelerator.unwrap_model(self.model), files,
                                 save_safetensors=self.args.save_safetensors, processing_class=self.processing_class,
                                 model_only=only_model)
        trainer_logger().info(f"Saving model checkpoint to {path}")
        if self.accelerator.is_main_process:
            rotate_checkpoints_of(out, self.args.save_total_limit, self.state.best_model_checkpoint)
        self._event("on_save")
        return path

    def _finish(self, start_time: float) -> TrainOutput:
        s = self.state
        self._read_scaler_into_state()  # the skip count is exact at the end, whatever logging_steps
        if self._steps_since_log:
            s.total_loss += self.accelerator.reduce(self._loss_since_log.total(), "mean").item()
        runtime = time.time() - start_time
        if self.args.load_best_model_at_end and s.best_model_checkpoint is not None:
            trainer_logger().info(f"Loading best model from {s.best_model_checkpoint} (score: {s.best_metric}).")
            load_checkpoint_weights(self.accelerator.unwrap_model(self.model), Path(s.best_model_checkpoint),
                                    self.accelerator.device)
        metrics = {"train_runtime": round(runtime, 4),
                   "train_samples_per_second": round(s.global_step * self.get_total_train_batch_size(self.args)
                                                     / max(runtime, 1e-9), 3),
                   "train_steps_per_second": round(s.global_step / max(runtime, 1e-9), 3),
                   "train_loss": s.total_loss / max(1, s.global_step)}
        self.store_flos()
        self._flush_tokens()
        metrics["total_flos"] = float(s.total_flos)
        self._memory_tracker.stop("train", metrics)
        if self._preempted_at is None:  # a preempted run's summary would be logged past its checkpoint
            self.log(metrics)
        # What transformers returns (with its default progress bar): the logged summary and the epoch.
        if s.epoch is not None:
            metrics["epoch"] = s.epoch
        self._event("on_train_end")
        return TrainOutput(s.global_step, metrics["train_loss"], metrics)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: mixprec does not upload (push ``output_dir`` with ``huggingface_hub``)."""
        raise NotImplementedError("Trainer.push_to_hub is not supported by mixprec; upload output_dir with "
                                  "huggingface_hub.upload_folder(repo_id=..., folder_path=args.output_dir)")

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: run your search library's loop around ``Trainer(model_init=...).train()``."""
        raise NotImplementedError("Trainer.hyperparameter_search is not supported by mixprec; call train() from "
                                  "your search library's objective (model_init builds a fresh model each time)")

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss and ``compute_metrics`` on the eval set(s); logged and passed to ``on_evaluate``.
        ``eval_dataset`` may name one of a dict of eval datasets (its metrics get the name too)."""
        override = eval_dataset is not None
        ds = eval_dataset if override else self.eval_dataset
        if isinstance(ds, dict):  # each by name (the loader asked for by name, as transformers asks)
            metrics: dict[str, float] = {}
            for name, part in ds.items():
                metrics.update(self.evaluate(part if override else name, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        self._memory_tracker.start("eval")
        # Without compute_metrics only the loss is computed, as in transformers.
        out = self.evaluation_loop(self.get_eval_dataloader(ds), description="Evaluation",
                                   prediction_loss_only=True if self.compute_metrics is None else None,
                                   ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self.log(out.metrics)  # (which adds the epoch to them, as transformers' log does)
        self._event("on_evaluate", metrics=out.metrics)
        self._memory_tracker.stop("eval", out.metrics)  # returned, not logged (as transformers)
        return out.metrics

    # -- Hugging Face's helpers ---------------------------------------------------------------
    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        """A no-op context, as in transformers: the prepared model's forward runs in the precision itself."""
        return contextlib.nullcontext()

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The contexts :meth:`compute_loss` runs in (none here: the precision is the prepared model's)."""
        stack = contextlib.ExitStack()
        ctx = self.autocast_smart_context_manager()
        if not isinstance(ctx, contextlib.nullcontext):
            stack.enter_context(ctx)
        return stack

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple[int, int, int, int, int, int, int]:
        """transformers' ``(num_train_epochs, num_update_steps_per_epoch, num_examples,
        num_train_samples, total_train_batch_size, steps_in_epoch, max_steps)`` for ``dataloader``:
        ``max_steps`` from ``args.max_steps``, else from the epochs and the loader's length.

        Raises:
            ValueError: the loader has no length and ``max_steps`` is not set.
        """
        batches, ga = _length(dataloader), args.gradient_accumulation_steps
        total = self.get_total_train_batch_size(args)
        if batches:
            per_epoch = max(1, math.ceil(batches / ga))
            max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
            epochs = math.ceil(max_steps / per_epoch) if args.max_steps > 0 else math.ceil(args.num_train_epochs)
            examples = self.num_examples(dataloader)
            samples = max_steps * total if args.max_steps > 0 else examples * args.num_train_epochs
            return epochs, per_epoch, examples, samples, total, batches, max_steps
        if args.max_steps <= 0:
            raise ValueError("the train dataset has no length: set max_steps to say how long to train")
        return (sys.maxsize, args.max_steps, total * args.max_steps, total * args.max_steps, total, args.max_steps * ga,
                args.max_steps)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any = None) -> tuple[list, Any]:
        """The next ``num_batches`` batches of ``epoch_iterator`` (fewer at its end) and the number of
        label tokens in them (labels other than -100, summed over every process; ``None`` without
        ``labels``), as transformers counts ``num_items_in_batch`` (mixprec's loop does not pass it:
        the loss is the model's own mean)."""
        batches = list(itertools.islice(epoch_iterator, num_batches))
        if not batches or not isinstance(batches[0], Mapping) or "labels" not in batches[0]:
            return batches, None
        count = sum(int(b["labels"].ne(-100).sum()) for b in batches)
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            count = int(self.accelerator.reduce(torch.tensor(count, device=self.accelerator.device), "sum"))
        return batches, torch.tensor(count, device=device) if device is not None else count

    def evaluation_loop(self, dataloader: Any, description: str = "Evaluation", prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Predictions, labels, metrics and the number of samples of ``dataloader``, as
        ``evaluate`` and ``predict`` compute them (without logging or callbacks' ``on_evaluate``)."""
        return self._run_evaluation(dataloader, ignore_keys, metric_key_prefix, prediction_loss_only,
                                    description=description)

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """Write a draft model card, ``output_dir/README.md``, from what the Trainer knows: the
        hyperparameters, the evaluation results logged, the precision and the versions (main process)."""
        if self.is_world_process_zero():
            write_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                             finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags,
                             dataset=dataset, dataset_args=dataset_args)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Not supported: mixprec does not create Hub repositories (``huggingface_hub.create_repo``)."""
        raise NotImplementedError("Trainer.init_hf_repo is not supported by mixprec (it does not upload); create the "
                                  "repository with huggingface_hub.create_repo(repo_id)")

    def num_examples(self, dataloader: Any) -> int:
        """Samples in ``dataloader``'s dataset; estimated from its length where the dataset has none."""
        try:
            return len(dataloader.dataset)
        except (NameError, AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """Forward+backward FLOPs of one batch as transformers estimates them (6 x tokens x
        non-embedding parameters) for a model that counts its parameters; 0 otherwise."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if isinstance(inputs, Mapping) and main in inputs and hasattr(self.model, "num_parameters"):
            if self._counted_params is None:  # walks every parameter (0.4 ms for GPT-2): once per train()
                self._counted_params = self.model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main].numel() * self._counted_params
        return 0

    def _input_tokens(self, batch: Any) -> Any:
        """This process's input tokens in ``batch`` (``include_num_input_tokens_seen``), on the
        device: all of the main input's, or the attention mask's ones for ``"non_padding"``."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if not isinstance(batch, Mapping) or main not in batch:
            return 0
        if self.args.include_num_input_tokens_seen == "non_padding":
            if "attention_mask" in batch:
                return batch["attention_mask"].sum()
            pad = getattr(self.processing_class, "pad_token_id", None)
            if pad is not None:
                return (batch[main] != pad).sum()
        return batch[main].numel()

    def _flush_tokens(self) -> None:
        """Add the tokens counted since the last call (every process's) to ``state.num_input_tokens_seen``."""
        if self.args.include_num_input_tokens_seen == "no":
            return
        acc = self.accelerator
        count = torch.as_tensor(self._tokens_since_log, dtype=torch.int64, device=acc.device)
        self.state.num_input_tokens_seen += int(acc.reduce(count, "sum").item())
        self._tokens_since_log = 0

    def store_flos(self) -> None:
        """Add the FLOPs counted since the last call (over all processes) to ``state.total_flos``."""
        flos = self.current_flos
        if self.accelerator.num_processes > 1:
            flos = float(self.accelerator.reduce(torch.tensor(flos, dtype=torch.float64, device=self.accelerator.device),
                                                 "sum").item())
        self.state.total_flos = float(self.state.total_flos) + flos
        self.current_flos = 0.0

    def get_tp_size(self) -> int:
        """Tensor-parallel size: 1 (mixprec shards data, not layers)."""
        return 1

    def get_cp_size(self) -> int:
        """Context-parallel size: 1."""
        return 1

    def get_sp_size(self) -> int:
        """Sequence-parallel size: 1."""
        return 1

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step over all processes: per-device batch (as ``auto_find_batch_size``
        left it) x accumulation x processes."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes

    def end(self) -> None:
        """Finish the trackers and the process group; call it once, at the very end of the script."""
        self.accelerator.end_training()

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (numpy), labels (where present) and metrics on ``test_dataset``."""
        self._memory_tracker.start("test")
        out = self.evaluation_loop(self.get_test_dataloader(test_dataset), description="Prediction",
                                   ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        self._event("on_predict", metrics=out.metrics)
        self._memory_tracker.stop("test", out.metrics)
        return PredictionOutput(out.predictions, out.label_ids, out.metrics)

    def _run_evaluation(self, dl: Any, ignore_keys: list[str] | None, prefix: str,
                        prediction_loss_only: bool | None = None, description: str = "Evaluation") -> EvalLoopOutput:
        if not self.is_in_train and self.state.global_step == 0 and not hasattr(self, "model_preparation_time"):
            # transformers prepares the model in the first evaluation made before training, and
            # reports the seconds it took (``eval_model_preparation_time``) from then on; mixprec
            # prepared it when the Trainer was made, and reports those seconds where it would.
            self.model_preparation_time = self._preparation_seconds
        hf_log = trainer_logger()  # transformers' header lines, at INFO
        hf_log.info(f"\n***** Running {description} *****")
        hf_log.info(f"  Num examples = {self.num_examples(dl)}" if _length(dl) is not None else "  Num examples: Unknown")
        hf_log.info(f"  Batch size = {getattr(dl, 'batch_size', None) or self.args.eval_batch_size}")
        dl = self._loop_loader(dl, checkpoint=False)
        self.callback_handler.eval_dataloader = dl
        a = self.args
        return evaluation_loop(self, dl, ignore_keys, prefix,
                               on_step=lambda: self._event("on_prediction_step"),
                               prediction_loss_only=(a.prediction_loss_only if prediction_loss_only is None
                                                     else prediction_loss_only),
                               batch_metrics=a.batch_eval_metrics,
                               concat_batches=a.eval_do_concat_batches,
                               include=tuple(a.include_for_metrics))

    def prediction_step(self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """``(loss, logits, labels)`` of one evaluation batch, without gradients (override to change
        what evaluation computes; ``logits`` is everything the model returned but the loss)."""
        with self.evaluation_precision_context():
            return predict_batch(self, model, inputs, prediction_loss_only, ignore_keys)

    def evaluation_precision_context(self) -> contextlib.AbstractContextManager:
        """The context :meth:`prediction_step` computes in: ``fp16_full_eval`` / ``bf16_full_eval``
        autocast to that dtype (mixprec autocasts instead of casting the weights, as transformers'
        ``.half()`` does, so training can go on after an evaluation); else none (the prepared
        model's forward runs in the training precision)."""
        if self.args.fp16_full_eval or self.args.bf16_full_eval:
            dtype = torch.float16 if self.args.fp16_full_eval else torch.bfloat16
            return torch.autocast(self.accelerator.device.type, dtype=dtype)
        return contextlib.nullcontext()

    # -- the way out --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> Path:
        """Save the model's weights (safetensors; ``save_pretrained`` for Hugging Face models) and
        the arguments (``training_args.json``, and ``training_args.bin`` as Hugging Face writes it)."""
        return save_model_files(self.accelerator, self.model, self.args, self.processing_class,
                                Path(output_dir or self.args.output_dir))

    def save_state(self) -> None:
        """Write ``trainer_state.json`` into ``output_dir`` (main process only), as Hugging Face does."""
        if self.accelerator.is_main_process:
            Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(Path(self.args.output_dir) / "trainer_state.json")

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` readably under ``***** {split} metrics *****`` (main process only)."""
        if self.accelerator.is_main_process:
            print_metrics(split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``output_dir/{split}_results.json`` (and merge into ``all_results.json``)."""
        if self.accelerator.is_main_process:
            write_metrics(self.args.output_dir, split, metrics, combined)

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """``metrics`` made readable (runtimes as h:mm:ss, floats to 4 digits)."""
        return format_metrics(metrics)


def _kubeflow_callback() -> Any:
    """transformers' ``KubeflowCallback`` (``report_to="kubeflow"``: progress and metrics to the
    Kubeflow Trainer controller of the TrainJob this runs in)."""
    try:
        from transformers.integrations import KubeflowCallback
    except ImportError:
        raise ImportError("report_to='kubeflow' reports through transformers' KubeflowCallback: pip install "
                          "transformers (or mixprec[hf])") from None
    return KubeflowCallback


def _empty_device_cache(device: torch.device) -> None:
    """Give the device's cached, unused memory back (``torch_empty_cache_steps``); the CPU has none."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":  # pragma: no cover - no Apple hardware in CI
        torch.mps.empty_cache()


def enable_full_determinism(seed: int) -> None:
    """``set_seed`` and deterministic kernels (``full_determinism``), as transformers'
    ``enable_full_determinism``: torch's deterministic algorithms, cuDNN's deterministic choice and
    cuBLAS's fixed workspace; slower, and an error for an operator without a deterministic kernel."""
    set_seed(seed)
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _label_smoother(epsilon: float, model: torch.nn.Module) -> Any:
    """transformers' ``LabelSmoother(epsilon)``, or ``None`` for no smoothing; as transformers' Trainer,
    ``None`` with its ``UserWarning`` for a multi-label classifier (``model.config.problem_type ==
    "multi_label_classification"``), whose labels are not one class index to smooth."""
    if not epsilon:
        return None
    if getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
        # transformers' words and category; stacklevel: the line that made the Trainer.
        warnings.warn("Label smoothing is not compatible with multi-label classification. "
                      "Disabling label smoothing for this training run.", UserWarning, stacklevel=3)
        return None
    try:
        from transformers.trainer_pt_utils import LabelSmoother
    except ImportError:
        raise ImportError("label_smoothing_factor uses transformers' LabelSmoother: pip install transformers (or "
                          "mixprec[hf]); or compute the smoothed loss with compute_loss_func") from None
    return LabelSmoother(epsilon=epsilon)


def _is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether transformers names ``model``'s class a causal language model (its labels are shifted)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return model_to_inspect(model)._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _activate_neftune(model: torch.nn.Module, alpha: float | None, accelerator: Any) -> Any:
    """NEFTune's noise on the input embeddings during training (``neftune_noise_alpha``), by
    transformers' own hook; returns its handle (``None`` without NEFTune)."""
    if alpha is None:
        return None
    try:
        from transformers.integrations.neftune import activate_neftune
    except ImportError:
        raise ImportError("neftune_noise_alpha uses transformers' NEFTune hook: pip install transformers (or "
                          "mixprec[hf])") from None
    inner = accelerator.unwrap_model(model)
    if not hasattr(inner, "get_input_embeddings"):
        raise ValueError(f"neftune_noise_alpha adds noise to the input embeddings, which {type(inner).__name__} does "
                         "not expose (get_input_embeddings(), as Hugging Face models do); leave it unset")
    return activate_neftune(model, alpha, accelerator)


def _length(loader: Any) -> int | None:
    """``len(loader)``, or ``None`` for a loader without a length (an ``IterableDataset``)."""
    try:
        return len(loader)
    except TypeError:
        return None

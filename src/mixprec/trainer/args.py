"""TrainingArguments: the Hugging Face names and meanings, validated when built."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import logging
import math
import os
import warnings
from dataclasses import KW_ONLY, InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.distributed.fsdp import FullyShardedDataParallelPlugin
from mixprec.hardware import default_device
from mixprec.precision import PrecisionConfig, canonical_precision
from mixprec.trainer.schedules import METRIC_DRIVEN, SCHEDULER_TYPES, optimizer_names

__all__ = ["TrainingArguments"]

_STRATEGIES = ("no", "steps", "epoch")

# mixprec's own loggers; every tracker of mixprec.tracking (wandb, mlflow, ...) is a report_to name too.
_OWN_REPORTERS = ("none", "jsonl", "tensorboard", "all")
# transformers' report_to names for integrations mixprec's tracking layer does not have.
_NOT_INTEGRATED = ("azure_ml", "codecarbon", "dagshub", "flyte", "neptune")
# Hugging Face's AcceleratorConfig fields: DataLoaderConfiguration's, and the accumulation's and state's.
_ACCELERATOR_CONFIG = {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                       "use_seedable_sampler": True, "non_blocking": False, "gradient_accumulation_kwargs": None}
_DEBUG = ("underflow_overflow", "tpu_metrics_debug")
# transformers' log level names ("passive": leave the level as it is).
_LOG_LEVELS = {"detail": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
               "error": logging.ERROR, "critical": logging.CRITICAL, "passive": -1}
_SAMPLING = ("random", "sequential", "group_by_length", "batch_rebalance")

# Hugging Face fields for features mixprec does not have. They exist (code that reads them works)
# and keep Hugging Face's default; any other value is refused with the field's name and why,
# rather than silently ignored.
_UNSUPPORTED = {
    "push_to_hub": "mixprec does not upload; push output_dir with huggingface_hub's upload_folder",
    "hub_token": "mixprec does not upload to the Hub", "hub_private_repo": "mixprec does not upload to the Hub",
    "hub_model_id": "mixprec does not upload to the Hub", "hub_strategy": "mixprec does not upload to the Hub",
    "hub_always_push": "mixprec does not upload to the Hub", "hub_revision": "mixprec does not upload to the Hub",
    "deepspeed": "DeepSpeed is not integrated; mixprec shards with FSDP2 through torchrun",
    "parallelism_config": "mixprec runs data parallelism only",
    "use_liger_kernel": "Liger kernels are not integrated", "liger_kernel_config": "Liger kernels are not integrated",
    "trackio_space_id": "trackio Spaces are not integrated (report_to='trackio' logs locally)",
    "trackio_bucket_id": "trackio Spaces are not integrated", "trackio_static_space_id": "trackio Spaces are not integrated",
    "optim_target_modules": "optimizers such as GaLore are not integrated",
}


# The fields transformers also takes as a JSON object's text.
_DICT_FIELDS = ("accelerator_config", "fsdp_config", "deepspeed", "activation_checkpointing_kwargs",
                "gradient_checkpointing_kwargs", "lr_scheduler_kwargs")


def _typed_values(d: dict[str, Any]) -> dict[str, Any]:
    """A JSON object's text values read as transformers reads them: "true"/"false" as bools,
    digits as numbers, nested objects alike."""
    for key, value in d.items():
        if isinstance(value, dict):
            d[key] = _typed_values(value)
        elif isinstance(value, str):
            if value.lower() in ("true", "false"):
                d[key] = value.lower() == "true"
            elif value.isdigit():
                d[key] = int(value)
            elif value.replace(".", "", 1).isdigit():
                d[key] = float(value)
    return d


def _reporter_names() -> tuple[str, ...]:
    from mixprec.tracking.registry import TRACKER_CLASSES

    return (*_OWN_REPORTERS, *(n for n in TRACKER_CLASSES if n not in _OWN_REPORTERS))


def _default(name: str) -> Any:
    f = TrainingArguments.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of: {', '.join(map(repr, choices))}")


def _plain(value: Any) -> Any:
    """A Hugging Face enum member (``IntervalStrategy.EPOCH``) as its plain value (``"epoch"``)."""
    return value.value if isinstance(value, enum.Enum) else value


@dataclass
class TrainingArguments:
    """What a :class:`~mixprec.Trainer` run does, with Hugging Face's names, defaults and meanings.

    A plain (mutable) dataclass, validated in ``__post_init__``, as Hugging Face's is: subclass it
    with a plain ``@dataclass`` to add fields, pass ``output_dir`` as the first positional
    argument (the other fields are keyword-only), set fields after construction (the Trainer
    checks them again with :meth:`validate` when it starts). ``logging_steps``, ``eval_steps``,
    ``save_steps`` and ``warmup_steps`` below 1 are fractions of the training steps. Hugging
    Face fields for features mixprec lacks (Hub upload, DeepSpeed, integrations) exist at their
    defaults; any other value raises an error that names the field.

    Beyond Hugging Face: ``precision`` takes any name :func:`~mixprec.resolve_precision` accepts
    (``fp16=True`` means ``"fp16-mixed"``, ``bf16=True`` means ``"bf16-mixed"``), and
    ``loss_scaler`` takes :class:`~mixprec.LossScaler` keyword arguments. The precision
    diagnostics: ``diagnostics_steps`` (gradient statistics every N steps, logged), ``trace_overflow``
    (name the first overflowing module), ``drift_steps`` (every N steps the batch's loss in fp32
    beside the mixed one); ``on_loss_scale_collapse="fallback"`` switches a collapsing fp16 run to
    bf16-mixed (or fp32) instead of raising; ``skip_nonfinite_steps`` makes fp32, bf16-mixed and
    bf16-true skip an optimizer step whose gradients hold inf/NaN, as fp16 does (counted in
    ``state.skipped_steps``, logged with the step numbers in ``skipped_steps_at``; ~2% step time
    on pycode small, and one host sync per step: the schedule reads whether the step was applied):
    ``True`` on, ``None`` on where the precision has it (every one), ``False`` (default) off. A checkpoint that cannot be written (a full
    disk, a quota) leaves the previous one complete; ``on_save_error="raise"`` (default) stops the
    run with an error naming the folder and the bytes needed, ``"warn"`` logs it and trains on to
    the next save. With ``precision="bf16-true"``,
    ``bf16_true_compensation`` (``"kahan"``, ``"stochastic"``, ``"none"``) and
    ``bf16_true_state_dtype`` (``"fp32"``, ``"bf16"``: the moments, half the optimizer memory) are
    the Accelerator's arguments of the same names. ``report_to="jsonl"`` (the default) appends
    every log to ``output_dir/metrics.jsonl``. The old spelling ``evaluation_strategy`` is
    accepted with a ``FutureWarning``. :meth:`replace` gives a changed copy, validated again.

    Example:
        >>> args = TrainingArguments("out", eval_strategy="epoch", bf16=True)
        >>> args.resolved_precision
        'bf16-mixed'
        >>> args.logging_steps = 10  # settable, as in Hugging Face
    """

    output_dir: str | None = None
    _: KW_ONLY
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    eval_on_start: bool = False
    eval_accumulation_steps: int | None = None
    batch_eval_metrics: bool = False
    prediction_loss_only: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    #: transformers 4's field (5 always writes safetensors): ``False`` writes checkpoints' and
    #: ``save_model``'s weights as ``pytorch_model.bin``.
    save_safetensors: bool = True
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = True
    log_level: str = "passive"
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    run_name: str | None = None
    project: str = "huggingface"
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    optim: str = "adamw_torch"
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    seed: int = 42
    data_seed: int | None = None
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    gradient_checkpointing: bool | None = False
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    activation_checkpointing: bool | None = False
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    use_cache: bool = False
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    restore_callback_states_from_checkpoint: bool = False
    report_to: None | str | list[str] = "jsonl"
    disable_tqdm: bool | None = None
    resume_from_checkpoint: str | None = None
    torch_compile: bool = False
    use_cpu: bool = False
    # mixprec's own
    precision: str | None = None
    loss_scaler: dict[str, Any] | None = field(default=None)
    on_loss_scale_collapse: str = "raise"
    skip_nonfinite_steps: bool | None = False
    on_save_error: str = "raise"
    bf16_true_compensation: str = "kahan"
    bf16_true_state_dtype: str = "fp32"
    diagnostics_steps: int = 0
    trace_overflow: bool = False
    drift_steps: int = 0
    # Sharding with FSDP2 (Hugging Face's names): see the fsdp_plugin property
    fsdp: str | None = None  # (or True, or a list of options)
    fsdp_config: dict[str, Any] | str | None = None
    # Hugging Face's, unsupported: only their defaults are accepted (see _UNSUPPORTED)
    push_to_hub: bool = False
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    deepspeed: dict | str | None = None
    accelerator_config: dict | str | None = None  # (or transformers' AcceleratorConfig)
    parallelism_config: dict | str | None = None
    use_liger_kernel: bool = False
    liger_kernel_config: dict[str, Any] | None = None
    neftune_noise_alpha: float | None = None
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None = None
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    optim_args: str | None = None
    optim_target_modules: None | str | list[str] = None
    lr_scheduler_kwargs: dict | str | None = None
    label_smoothing_factor: float = 0.0
    tf32: bool | None = None
    auto_find_batch_size: bool = False
    include_num_input_tokens_seen: str | bool = "no"
    save_only_model: bool = False
    save_on_each_node: bool = False
    enable_jit_checkpoint: bool = False
    ignore_data_skip: bool = False
    full_determinism: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    include_for_metrics: list[str] = field(default_factory=list)
    dataloader_in_order: bool = True
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    debug: str | list[str] = ""
    torch_empty_cache_steps: int | None = None
    skip_memory_metrics: bool = True
    local_rank: int = -1
    evaluation_strategy: InitVar[str | None] = None

    def __post_init__(self, evaluation_strategy: str | None) -> None:
        if evaluation_strategy is not None:
            warnings.warn("`evaluation_strategy` is deprecated; use `eval_strategy` (same values)", FutureWarning, stacklevel=3)
            evaluation_strategy = _plain(evaluation_strategy)
            if _plain(self.eval_strategy) not in ("no", evaluation_strategy):
                raise ValueError(f"evaluation_strategy={evaluation_strategy!r} and eval_strategy={self.eval_strategy!r} "
                                 "disagree; pass only eval_strategy")
            self.eval_strategy = evaluation_strategy
        self.validate()

    @property
    def fsdp_plugin(self) -> Any:
        """The :class:`~mixprec.FullyShardedDataParallelPlugin` that ``fsdp`` / ``fsdp_config`` ask for
        (``None`` without sharding): ``fsdp="full_shard"`` (or ``"shard_grad_op"``) with
        Hugging Face's ``fsdp_config`` keys (``transformer_layer_cls_to_wrap``, ...)."""

        return plugin_from_training_args(self.fsdp, self.fsdp_config)

    def validate(self) -> None:
        """Check every field (and fill the ones that default to others); the Trainer calls it again
        when it starts, so values assigned after construction are checked too.

        Raises:
            ValueError: naming the field, the bad value and the fix.
        """
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self.output_dir = os.path.expanduser(os.fspath(self.output_dir))  # "~/runs" as transformers expands it
        for name in _DICT_FIELDS:  # a JSON object given as text (the command line), read as transformers reads it
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):
                setattr(self, name, _typed_values(json.loads(value)))
        if self.use_cpu:  # as transformers: no pinned memory without a device to copy to
            self.dataloader_pin_memory = False
        for name in ("eval_strategy", "save_strategy", "logging_strategy", "optim", "lr_scheduler_type",
                     "hub_strategy", "train_sampling_strategy"):
            setattr(self, name, _plain(getattr(self, name)))
        if self.disable_tqdm is None:  # Hugging Face's default: show progress (mixprec has no log-level switch)
            self.disable_tqdm = False
        if self.eval_strategy != "no":  # as in Hugging Face: evaluating means do_eval
            self.do_eval = True
        if self.report_to is None:
            self.report_to = "none"
        for name, why in _UNSUPPORTED.items():
            if name.startswith("hub_") and not self.push_to_hub:
                continue  # Hub settings do nothing without push_to_hub, in transformers too
            value, default = getattr(self, name), _default(name)
            if value != default:
                raise ValueError(f"{name}={value!r} is not supported by mixprec's Trainer ({why}); leave {name} at "
                                 f"its default {default!r}")
        self.fsdp_plugin  # noqa: B018 - fsdp / fsdp_config are checked here, with the option's name
        for name in ("eval_strategy", "logging_strategy"):
            _one_of(name, getattr(self, name), _STRATEGIES)
        _one_of("save_strategy", self.save_strategy, (*_STRATEGIES, "best"))
        if self.save_strategy == "best" and ((self.metric_for_best_model is None and not self.load_best_model_at_end)
                                             or self.eval_strategy == "no"):
            raise ValueError("save_strategy='best' saves when an evaluation finds a new best metric_for_best_model: "
                             "set metric_for_best_model (e.g. 'loss') and eval_strategy to 'steps' or 'epoch'")
        _one_of("optim", self.optim, optimizer_names())
        _one_of("train_sampling_strategy", self.train_sampling_strategy, _SAMPLING)
        _one_of("on_loss_scale_collapse", self.on_loss_scale_collapse, ("raise", "fallback"))
        _one_of("on_save_error", self.on_save_error, ("raise", "warn"))
        env_rank = os.environ.get("LOCAL_RANK")
        if self.local_rank != -1 and str(self.local_rank) != (env_rank if env_rank is not None else "0"):
            raise ValueError(f"local_rank={self.local_rank} disagrees with the launcher's LOCAL_RANK ({env_rank}): "
                             "launch with torchrun (or accelerate launch), which sets LOCAL_RANK, and leave "
                             "local_rank at -1 (it is read from there)")
        if self.save_on_each_node and self.world_size > int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)):
            raise ValueError("save_on_each_node=True on several machines is not supported: mixprec writes each "
                             "checkpoint once, from the main process; give output_dir a filesystem every machine sees "
                             "and leave save_on_each_node False (on one machine it changes nothing)")
        for name in ("log_level", "log_level_replica"):
            _one_of(name, getattr(self, name), tuple(_LOG_LEVELS))
        self.precision_config  # noqa: B018 - validates the precision's options together
        for name in ("diagnostics_steps", "drift_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 switches it off), got {v!r}")
        _one_of("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_TYPES)
        if self.lr_scheduler_type in METRIC_DRIVEN and self.eval_strategy == "no":
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r} steps with the evaluation metric: "
                             "set eval_strategy ('steps' or 'epoch') so there is one")
        if not isinstance(self.report_to, str):
            self.report_to = [_plain(r) for r in self.report_to]
        if self.report_to in ("none", ["none"]):  # transformers' normalisation: no reporter is []
            self.report_to = []
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # as transformers: naming a backend or a mode asks for compilation
            self.torch_compile_backend = self.torch_compile_backend or "inductor"
        if self.tf32 is not None:
            import torch

            cuda = torch.cuda.is_available() and not self.use_cpu
            if self.tf32 and not (cuda and torch.cuda.get_device_capability() >= (8, 0)):
                raise ValueError("tf32=True needs an Ampere or newer GPU (CUDA compute capability 8.0+); none is "
                                 "used here: leave tf32 unset")
            if cuda:  # fp32 matrix products in TF32 (or not), as transformers sets it
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.tf32)
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers' older spelling
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        _one_of("include_num_input_tokens_seen", self.include_num_input_tokens_seen, ("no", "all", "non_padding"))
        if self.dataloader_prefetch_factor is not None and not self.dataloader_num_workers:
            raise ValueError("dataloader_prefetch_factor can only be set when data is loaded in other processes: set "
                             "dataloader_num_workers > 0, or leave dataloader_prefetch_factor unset")
        reporters = [self.report_to] if isinstance(self.report_to, str) else self.report_to
        for r in reporters:
            if r in _NOT_INTEGRATED:
                raise ValueError(f"report_to={r!r}: that integration is not part of mixprec; choose among "
                                 f"{', '.join(map(repr, _reporter_names()))}, or add a TrainerCallback that logs to it")
            _one_of("report_to", r, _reporter_names())
        self.accelerator_config = self.accelerator_settings()
        self.debug = self.debug_options()
        self.include_for_metrics = [_plain(x) for x in self.include_for_metrics or []]
        for x in self.include_for_metrics:
            _one_of("include_for_metrics", x, ("inputs", "loss"))
        self._check_numbers()
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True contradict each other; set only one (bf16 is the safer choice "
                             "where the hardware has it: no loss scaling needed)")
        if self.precision is not None:
            canon = canonical_precision(self.precision)
            implied = "fp16-mixed" if self.fp16 else "bf16-mixed" if self.bf16 else None
            if implied is not None and canon != implied:
                raise ValueError(f"precision={self.precision!r} contradicts {'fp16' if self.fp16 else 'bf16'}=True; "
                                 "set one of them")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ValueError("load_best_model_at_end=True needs evaluation: set eval_strategy to 'steps' or 'epoch'")
            if self.save_strategy not in (self.eval_strategy, "best"):
                raise ValueError(f"load_best_model_at_end=True needs save_strategy and eval_strategy to match, got "
                                 f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}; set both "
                                 "to the same value")
            if self.eval_strategy == "steps" and self.save_strategy == "steps":
                self._check_save_is_multiple_of_eval()
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.label_names is not None:
            self.label_names = list(self.label_names)
        # One switch under two names (transformers 5's new one and the old), set together as transformers sets them.
        self.gradient_checkpointing = self.activation_checkpointing = self.should_checkpoint_activations

    def _check_save_is_multiple_of_eval(self) -> None:
        save, every = self.save_steps, self.eval_steps
        if (save < 1) != (every < 1):
            raise ValueError(f"load_best_model_at_end=True needs save_steps ({save}) and eval_steps ({every}) both "
                             "as step counts or both as fractions of training")
        ratio = save / every
        if abs(ratio - round(ratio)) > 1e-9 or round(ratio) < 1:
            raise ValueError(f"load_best_model_at_end=True needs save_steps ({save}) to be a multiple of "
                             f"eval_steps ({every}), so every checkpoint has an evaluation")

    def _check_numbers(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            positive_int(name)
        for name in ("eval_accumulation_steps", "dataloader_prefetch_factor"):
            positive_int(name, allow_none=True)
        limit = self.save_total_limit  # 0 or less keeps every checkpoint, as in transformers
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise ValueError(f"save_total_limit must be an int or None, got {limit!r}")
        for name in ("logging_steps", "save_steps", "eval_steps"):
            self._check_steps(name)
        if not isinstance(self.max_steps, int) or self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps must be -1 (use num_train_epochs) or an int >= 1, got {self.max_steps!r}")
        if not (isinstance(self.num_train_epochs, (int, float)) and math.isfinite(self.num_train_epochs)
                and self.num_train_epochs > 0):
            raise ValueError(f"num_train_epochs must be a number > 0, got {self.num_train_epochs!r}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate >= 0):
            raise ValueError(f"learning_rate must be a number >= 0, got {self.learning_rate!r}")
        if not (0.0 <= self.warmup_ratio < 1.0):
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.warmup_steps < 0 or self.dataloader_num_workers < 0 or self.eval_delay < 0:
            raise ValueError("warmup_steps, eval_delay and dataloader_num_workers must be >= 0")
        if self.warmup_steps > 1 and self.warmup_steps != int(self.warmup_steps):
            raise ValueError(f"warmup_steps must be an integer, or a fraction in (0, 1) of the training steps, got "
                             f"{self.warmup_steps!r}")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 or None: no clipping), got {self.max_grad_norm!r}")

    def _check_steps(self, name: str) -> None:
        """``*_steps``: an int >= 1, or a fraction in (0, 1) of the training steps (Hugging Face's rule)."""
        v = getattr(self, name)
        if v is None and name == "eval_steps":
            return
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be an int >= 1, or a fraction in (0, 1) of the training steps, got {v!r}")
        if v >= 1:
            if v != int(v):
                raise ValueError(f"{name}={v!r}: above 1 it must be a whole number of steps (below 1 it is a fraction "
                                 "of the training steps)")
            setattr(self, name, int(v))

    # -- derived ---------------------------------------------------------------------------
    @property
    def train_batch_size(self) -> int:
        """Samples per training batch on each process (``per_device_train_batch_size``: mixprec has
        no single-process multi-GPU mode that would multiply it)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch on each process."""
        return self.per_device_eval_batch_size

    @property
    def device(self) -> torch.device:
        """The device this process trains on: the CPU with ``use_cpu``, else CUDA, MPS or the CPU."""
        if self.use_cpu:
            return torch.device("cpu")
        if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # torchrun: one GPU per process
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return default_device()

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on CUDA, else 0 (each process drives one device)."""
        return 1 if self.device.type == "cuda" else 0

    @property
    def world_size(self) -> int:
        """Processes in the run (torchrun's ``WORLD_SIZE``; 1 without torchrun)."""
        return int(os.environ.get("WORLD_SIZE", 1))

    @property
    def process_index(self) -> int:
        """This process's rank (torchrun's ``RANK``; 0 without torchrun)."""
        return int(os.environ.get("RANK", 0))

    @property
    def local_process_index(self) -> int:
        """This process's rank on its machine (torchrun's ``LOCAL_RANK``; 0 without torchrun)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each machine (``log_on_each_node``), else
        the main process of the run."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    def get_process_log_level(self) -> int:
        """The ``logging`` level of this process: ``log_level`` where it logs (:attr:`should_log`),
        ``log_level_replica`` elsewhere; ``"passive"`` is the ``mixprec`` logger's level as it is."""
        level = _LOG_LEVELS[self.log_level if self.should_log else self.log_level_replica]
        return logging.getLogger("mixprec").getEffectiveLevel() if level == -1 else level

    @property
    def should_checkpoint_activations(self) -> bool:
        """``gradient_checkpointing`` or its newer name ``activation_checkpointing``."""
        return bool(self.gradient_checkpointing or self.activation_checkpointing)

    # -- derived ---------------------------------------------------------------------------
    @property
    def precision_config(self) -> PrecisionConfig:
        """The precision's options in one validated object (``loss_scaler``, ``skip_nonfinite_steps``
        (``None``: ``"auto"``), ``bf16_true_compensation``, ``bf16_true_state_dtype``,
        ``on_loss_scale_collapse``), as the Accelerator takes them."""
        return PrecisionConfig(loss_scaler=self.loss_scaler, on_loss_scale_collapse=self.on_loss_scale_collapse,
                               skip_nonfinite_steps="auto" if self.skip_nonfinite_steps is None else self.skip_nonfinite_steps,
                               bf16_true_compensation=self.bf16_true_compensation,
                               bf16_true_state_dtype=self.bf16_true_state_dtype)

    @property
    def resolved_precision(self) -> str:
        """The precision name the run uses: ``precision``, else from ``fp16``/``bf16``, else ``"fp32"``."""
        if self.precision is not None:
            return self.precision
        return "fp16-mixed" if self.fp16 else "bf16-mixed" if self.bf16 else "fp32"

    @property
    def reporters(self) -> set[str]:
        """The loggers asked for, with ``"all"`` expanded (as in transformers: every one installed here)."""
        asked = {self.report_to} if isinstance(self.report_to, str) else set(self.report_to)
        if "all" in asked:
            from mixprec.tracking.registry import installed_tracker_names

            return {"jsonl", *installed_tracker_names()}
        return asked - {"none"}

    def accelerator_settings(self) -> dict[str, Any]:
        """``accelerator_config`` (a dict, a JSON file's path, or transformers' ``AcceleratorConfig``)
        as a dict of every field of Hugging Face's ``AcceleratorConfig``, defaults filled in as
        transformers fills them (``use_seedable_sampler=True``).

        Raises:
            ValueError: a key that is no field (the message lists them), or ``use_configured_state``
                (mixprec's Trainer always builds its Accelerator from these arguments).
        """
        value = self.accelerator_config
        if value is None:
            return dict(_ACCELERATOR_CONFIG)
        if isinstance(value, (str, os.PathLike)):
            value = json.loads(Path(value).read_text())
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif hasattr(value, "to_dict"):
            value = value.to_dict()
        if not isinstance(value, dict):
            raise ValueError(f"accelerator_config must be a dict, a JSON file's path or an AcceleratorConfig, got "
                             f"{type(value).__name__}")
        value = dict(value)
        if value.pop("use_configured_state", False):
            raise ValueError("accelerator_config={'use_configured_state': True}: mixprec's Trainer builds its own "
                             "Accelerator from these arguments; leave use_configured_state False")
        unknown = sorted(set(value) - set(_ACCELERATOR_CONFIG))
        if unknown:
            raise ValueError(f"accelerator_config: unknown key(s) {unknown}; valid keys: "
                             f"{[*_ACCELERATOR_CONFIG, 'use_configured_state']}")
        return {**_ACCELERATOR_CONFIG, **value}

    def debug_options(self) -> list[str]:
        """``debug`` as a list of option names (a space-separated string or a list, as transformers takes it).

        ``"underflow_overflow"`` turns on mixprec's overflow tracer (``trace_overflow``): the first
        module whose output holds inf/NaN is named in the log. ``"tpu_metrics_debug"`` needs a TPU
        and is refused."""
        items = self.debug.split() if isinstance(self.debug, str) else [_plain(x) for x in self.debug or []]
        for x in items:
            _one_of("debug", x, _DEBUG)
            if x == "tpu_metrics_debug":
                raise ValueError("debug='tpu_metrics_debug' prints TPU metrics and mixprec does not run on TPUs; "
                                 "leave it out")
        return items

    def ddp_handlers(self) -> list[Any]:
        """The ``ddp_*`` settings as the Accelerator's handlers: DDP's ``find_unused_parameters``,
        ``bucket_cap_mb``, ``broadcast_buffers`` and ``static_graph``, and the process group's
        ``ddp_backend`` and ``ddp_timeout`` (seconds)."""
        from mixprec.accelerator.handlers import DistributedDataParallelKwargs, InitProcessGroupKwargs

        ddp = {k: v for k, v in (("find_unused_parameters", self.ddp_find_unused_parameters),
                                 ("bucket_cap_mb", self.ddp_bucket_cap_mb),
                                 ("broadcast_buffers", self.ddp_broadcast_buffers),
                                 ("static_graph", self.ddp_static_graph)) if v is not None}
        group = InitProcessGroupKwargs(backend=self.ddp_backend, timeout=datetime.timedelta(seconds=self.ddp_timeout))
        return ([DistributedDataParallelKwargs(**ddp)] if ddp else []) + [group]

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps: ``warmup_steps`` (a fraction of ``total_steps`` below 1) if set, else
        ``warmup_ratio`` of ``total_steps``."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(total_steps * (self.warmup_steps or self.warmup_ratio))

    # -- serialisation ---------------------------------------------------------------------
    def replace(self, **changes: Any) -> TrainingArguments:
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (JSON- and TOML-ready), as transformers gives them: enum
        members as their values, dtypes as their names (``"bfloat16"``), objects with a
        ``to_dict`` as dicts, and every ``*_token`` masked (``"<HUB_TOKEN>"``)."""
        def plain(v: Any) -> Any:
            if isinstance(v, enum.Enum):
                return v.value
            if isinstance(v, torch.dtype):
                return str(v).removeprefix("torch.")
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            if hasattr(v, "to_dict") and not isinstance(v, type):
                return v.to_dict()
            return v

        d = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}
        return {k: (f"<{k.upper()}>" if k.endswith("_token") else v) for k, v in d.items()}

    def to_json_string(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with the batch sizes, every value a bool, int, float or str (others as
        their ``str``): what trackers record as the run's configuration (transformers' method)."""
        d = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        return {k: v if type(v) in (bool, int, float, str, torch.Tensor) else str(v) for k, v in d.items()}

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON."""
        Path(path).write_text(self.to_json_string() + "\n")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every field's name, and the old spelling ``evaluation_strategy``."""
        return [f.name for f in dataclasses.fields(cls)] + ["evaluation_strategy"]

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "the arguments") -> TrainingArguments:
        """Build from a dict, refusing unknown keys with the list of valid ones."""
        # to_dict masks every *_token ("<HUB_TOKEN>"): a masked one read back is no token.
        values = {k: v for k, v in values.items() if not (k.endswith("_token") and v == f"<{k.upper()}>")}
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown TrainingArguments key(s) {', '.join(map(repr, unknown))} in {source}; valid keys: "
                             f"{', '.join(cls.field_names())}")
        return cls(**values)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> TrainingArguments:
        """Load what :meth:`to_json_file` wrote."""
        return cls.from_dict(json.loads(Path(path).read_text()), source=str(path))

    @classmethod
    def from_toml(cls, path: str | os.PathLike, table: str = "training") -> TrainingArguments:
        """Load the ``[table]`` table of a TOML file (the whole file if ``table`` is empty)."""
        try:
            import tomllib
        except ModuleNotFoundError:  # pragma: no cover - Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
        values = doc.get(table, {}) if table else doc
        if not isinstance(values, dict):
            raise ValueError(f"[{table}] in {path} must be a table of TrainingArguments fields")
        return cls.from_dict(values, source=f"[{table}] of {path}")


def plugin_from_training_args(fsdp: Any, fsdp_config: Any) -> FullyShardedDataParallelPlugin | None:
    """The plugin for Hugging Face's ``TrainingArguments(fsdp=..., fsdp_config=...)``.

    ``fsdp``: ``""``/``None``/``False`` (no sharding), ``True``, or options separated by spaces (or
    a list): ``"full_shard"`` (parameters resharded after forward), ``"shard_grad_op"`` (kept
    gathered until backward), ``"auto_wrap"`` (the default here). ``fsdp_config``: a dict of the
    plugin's fields under Hugging Face's names (``transformer_layer_cls_to_wrap``,
    ``reshard_after_forward``, ``activation_checkpointing``, ...), with or without ``fsdp_``.
    """
    if fsdp in (None, "", False, []) and not fsdp_config:
        return None
    options = ["full_shard"] if fsdp is True else (fsdp.split() if isinstance(fsdp, str) else list(fsdp or []))
    known = {"full_shard", "shard_grad_op", "auto_wrap"}
    for opt in options:
        if opt not in known:
            why = {"offload": "CPU offload is not supported yet", "hybrid_shard": "one node is sharded as a whole",
                   "hybrid_shard_zero2": "one node is sharded as a whole",
                   "no_shard": "without sharding, run DDP: leave fsdp unset"}.get(opt, "unknown option")
            raise ValueError(f"fsdp={fsdp!r}: {opt!r}: {why}; mixprec takes {sorted(known)}")
    config = dict(fsdp_config or {})
    if "shard_grad_op" in options:
        config.setdefault("reshard_after_forward", False)
    return FullyShardedDataParallelPlugin.from_config(config)

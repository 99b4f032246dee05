"""TrainingArguments: the Hugging Face names and meanings, validated when built."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import json
import logging
import math
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import KW_ONLY, InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.distributed.fsdp import FullyShardedDataParallelPlugin
from mixprec.hardware import default_device
from mixprec.precision import PrecisionConfig, canonical_precision
from mixprec.trainer.logs import get_verbosity
from mixprec.trainer.schedules import METRIC_DRIVEN, SCHEDULER_TYPES, optimizer_names

__all__ = ["ParallelMode", "TrainingArguments"]

_STRATEGIES = ("no", "steps", "epoch")
_HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
# The run's precision in Accelerate's words (transformers' ``args.mixed_precision``); others keep their name.
_ACCELERATE_PRECISION = {"fp32": "no", "fp16-mixed": "fp16", "bf16-mixed": "bf16"}

# mixprec's own loggers; every tracker of mixprec.tracking (wandb, mlflow, ...) is a report_to name too,
# and "kubeflow", transformers' own KubeflowCallback (progress to a Kubeflow TrainJob's controller).
_OWN_REPORTERS = ("none", "jsonl", "tensorboard", "all", "kubeflow")
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


def _in_kubeflow_trainjob() -> bool:
    """Whether this runs in a Kubeflow TrainJob that takes progress reports (transformers' test:
    ``KUBEFLOW_TRAINER_SERVER_URL`` set, ``DISABLE_KUBEFLOW_INTEGRATION`` not TRUE)."""
    return (os.environ.get("DISABLE_KUBEFLOW_INTEGRATION", "FALSE").upper() != "TRUE"
            and os.environ.get("KUBEFLOW_TRAINER_SERVER_URL") is not None)


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


class ParallelMode(enum.Enum):
    """How the processes of a run are arranged: transformers' ``training_args.ParallelMode`` (the
    same values), which :attr:`TrainingArguments.parallel_mode` returns where transformers is not installed."""

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"
    SAGEMAKER_MODEL_PARALLEL = "sagemaker_model_parallel"
    SAGEMAKER_DATA_PARALLEL = "sagemaker_data_parallel"
    TPU = "tpu"


def _parallel_modes() -> type[enum.Enum]:
    """transformers' ``ParallelMode`` where it is installed (so members compare equal to its own), else mixprec's."""
    try:
        from transformers.training_args import ParallelMode as theirs
    except ImportError:
        return ParallelMode
    return theirs


def _truth(value: Any) -> bool:
    """A flag given as a bool or as text (``"true"``, ``"1"``, ``"yes"``...), read as transformers reads ``fsdp_config``."""
    return str(value).lower() in ("y", "yes", "t", "true", "on", "1")


def _check_strategy(name: str, strategy: Any, steps: Any, choices: tuple[str, ...]) -> str:
    """A ``set_*`` builder's strategy as its plain value; ``"steps"`` with ``steps=0`` is refused (transformers' rule)."""
    strategy = _plain(strategy)
    _one_of(name, strategy, choices)
    if strategy == "steps" and steps == 0:
        raise ValueError("Setting `strategy` as 'steps' requires a positive value for `steps`.")
    return strategy


class _AcceleratorSettings(dict):
    """``accelerator_config`` once validated: a dict of Hugging Face's ``AcceleratorConfig`` fields
    that also reads them as attributes (``args.accelerator_config.split_batches``), as transformers' does."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"accelerator_config has no field {name!r}; fields: {sorted(self)}") from None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``AcceleratorConfig.to_dict``)."""
        return dict(self)


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

    transformers' other public names are here with its meanings: the grouped setters
    (:meth:`set_training`, :meth:`set_evaluate`, ... ; :meth:`set_push_to_hub` is refused),
    :meth:`main_process_first`, :attr:`parallel_mode`, :attr:`should_save`,
    :meth:`get_warmup_steps`, :attr:`mixed_precision`, :attr:`distributed_state`, ... Enum
    members (``IntervalStrategy.STEPS``) are held as their values, which compare equal to them.

    Example:
        >>> args = TrainingArguments("out", eval_strategy="epoch", bf16=True)
        >>> args.resolved_precision
        'bf16-mixed'
        >>> args.logging_steps = 10  # settable, as in Hugging Face
    """

    # transformers' class attributes (no fields): the optim default, and whether torch is 2.8 or newer
    # (where transformers defaults to "adamw_torch_fused"; mixprec's "adamw_torch" is fused wherever torch allows).
    default_optim = "adamw_torch"
    is_torch_greater_or_equal_than_2_8 = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 8)

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
    optim: str = default_optim
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    seed: int = 42
    data_seed: int | None = None
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    # None: unset (transformers' rule: the new name wins, the old one fills it in when unset; a bare
    # --activation_checkpointing on the command line means True)
    gradient_checkpointing: bool | None = field(default=None, metadata={"nargs": "?", "const": True})
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    activation_checkpointing: bool | None = field(default=None, metadata={"nargs": "?", "const": True})
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

    @property
    def fsdp_plugin_args(self) -> dict[str, Any] | None:
        """The keyword arguments of Accelerate's ``FullyShardedDataParallelPlugin`` that ``fsdp`` /
        ``fsdp_config`` stand for, as transformers computes them (FSDP2); ``None`` without ``fsdp``.
        mixprec shards with :attr:`fsdp_plugin`, built from the same two fields."""
        if not self.fsdp:
            return None
        config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in (self.fsdp_config or {}).items()}
        options = [] if self.fsdp is True else self.fsdp.split() if isinstance(self.fsdp, str) else self.fsdp
        for option in map(_plain, options):
            if option in ("full_shard", "shard_grad_op"):
                config.setdefault("reshard_after_forward", option == "full_shard")
            elif option == "offload":
                config.setdefault("cpu_offload", True)
        policy = config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
        layers = config.get("transformer_layer_cls_to_wrap")
        plugin: dict[str, Any] = {"fsdp_version": int(config.get("version", 2)),
                                  **({"cpu_offload": True} if config.get("cpu_offload") else {}),
                                  "auto_wrap_policy": policy}
        if policy == "SIZE_BASED_WRAP" and config.get("min_num_params", 0) > 0:
            plugin["min_num_params"] = config["min_num_params"]
        elif policy == "TRANSFORMER_BASED_WRAP" and layers is not None:
            plugin["transformer_cls_names_to_wrap"] = ",".join([layers] if isinstance(layers, str) else layers)
        plugin["cpu_ram_efficient_loading"] = _truth(config.get("cpu_ram_efficient_loading", False))
        plugin["state_dict_type"] = config.get("state_dict_type", "FULL_STATE_DICT")
        if "activation_checkpointing" in config:
            plugin["activation_checkpointing"] = _truth(config["activation_checkpointing"])
        plugin["reshard_after_forward"] = _truth(config.get("reshard_after_forward", True))
        return plugin

    def validate(self) -> None:
        """Check every field (and fill the ones that default to others), by transformers' rules
        (what its ``__post_init__`` refuses is refused, what it normalises is normalised) and
        mixprec's; the Trainer calls it again when it starts, so values assigned after
        construction are checked too.

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
        if isinstance(self.fsdp_config, (str, os.PathLike)):  # any other text is a JSON file's path, as in transformers
            self.fsdp_config = json.loads(Path(self.fsdp_config).read_text(encoding="utf-8"))
        self._resolve_checkpointing_aliases()
        if self.use_cpu:  # as transformers: no pinned memory without a device to copy to
            self.dataloader_pin_memory = False
        if (self.dataloader_multiprocessing_context is None and self.dataloader_num_workers > 1
                and torch.backends.mps.is_available()):
            self.dataloader_multiprocessing_context = "fork"  # as transformers: MPS workers must fork
        for name in ("eval_strategy", "save_strategy", "logging_strategy", "optim", "lr_scheduler_type",
                     "hub_strategy", "train_sampling_strategy"):
            setattr(self, name, _plain(getattr(self, name)))
        if self.disable_tqdm is None:  # transformers' default: progress bars unless its logs are quieter than warnings
            self.disable_tqdm = get_verbosity() > logging.WARNING
        if self.eval_delay is None:  # what transformers' set_evaluate() leaves by default: no delay
            self.eval_delay = 0
        if self.eval_strategy != "no":  # as in Hugging Face: evaluating means do_eval
            self.do_eval = True
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
        _one_of("hub_strategy", self.hub_strategy, _HUB_STRATEGIES)  # checked without push_to_hub too, as transformers does
        if self.save_strategy == "best" and self.metric_for_best_model is None and not self.load_best_model_at_end:
            # (transformers' Trainer refuses this when it is built; mixprec already here, with the same words)
            raise ValueError("save_strategy='best' saves when an evaluation improves metric_for_best_model, and none "
                             "is set: `args.metric_for_best_model` must be provided when using 'best' save_strategy "
                             "or if `args.load_best_model_at_end` is set to `True` (e.g. metric_for_best_model='loss')")
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ValueError("save_strategy='best' saves when an evaluation finds a new best metric_for_best_model: "
                             "set eval_strategy to 'steps' or 'epoch'")
        _one_of("optim", self.optim, optimizer_names(self.optim))
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
        self._normalise_report_to()
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True  # as transformers: naming a backend or a mode asks for compilation
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"  # transformers' default backend (off Gaudi and Neuron)
        if self.tf32 is not None:
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
        self.accelerator_config = _AcceleratorSettings(self.accelerator_settings())
        self.debug = self.debug_options()
        self.include_for_metrics = [_plain(x) for x in self.include_for_metrics or []]
        for x in self.include_for_metrics:
            _one_of("include_for_metrics", x, ("inputs", "loss"))
        if self.eval_strategy == "steps" and not self.eval_steps:  # unset (None or 0): logging_steps, as transformers
            self.eval_steps = self.logging_steps
        self._check_numbers()
        if self.fp16 and self.bf16:
            raise ValueError("fp16=True and bf16=True contradict each other; set only one (bf16 is the safer choice "
                             "where the hardware has it: no loss scaling needed)")
        if self.fp16_full_eval and self.bf16_full_eval:
            raise ValueError("fp16_full_eval=True and bf16_full_eval=True contradict each other; set only one")
        if self.precision is not None:
            canon = canonical_precision(self.precision)
            implied = "fp16-mixed" if self.fp16 else "bf16-mixed" if self.bf16 else None
            if implied is not None and canon != implied:
                raise ValueError(f"precision={self.precision!r} contradicts {'fp16' if self.fp16 else 'bf16'}=True; "
                                 "set one of them")
        self.resolved_precision  # noqa: B018 - checks the precision `accelerate launch --mixed_precision` set
        if self.load_best_model_at_end:
            if self.eval_strategy == "no" and self.save_strategy != "best":
                raise ValueError("load_best_model_at_end=True needs evaluation: set eval_strategy to 'steps' or 'epoch'")
            if self.save_strategy not in (self.eval_strategy, "best"):
                raise ValueError(f"load_best_model_at_end=True needs save_strategy and eval_strategy to match, got "
                                 f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}; set both "
                                 "to the same value")
            if self.eval_strategy == "steps" and self.save_strategy == "steps":
                self._check_save_is_multiple_of_eval()
        if self.metric_for_best_model is None and (self.load_best_model_at_end or self.lr_scheduler_type in METRIC_DRIVEN):
            self.metric_for_best_model = "loss"  # as transformers: the metric these compare
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.label_names is not None:
            self.label_names = list(self.label_names)

    def _resolve_checkpointing_aliases(self) -> None:
        """``gradient_checkpointing*`` as transformers 5 reads them: deprecated names of
        ``activation_checkpointing*``, taken (with a ``FutureWarning``) only where the new name is
        unset, then set to the new name's value so code reading either sees the same."""
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if getattr(self, new) is None and getattr(self, old) is not None:
                warnings.warn(f"`{old}` is deprecated and will be removed in transformers v6; use `{new}` instead",
                              FutureWarning, stacklevel=5)
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False

    def _normalise_report_to(self) -> None:
        """``report_to`` as transformers holds it, a list: ``"none"`` (or None) is ``[]``, ``"all"`` the
        loggers installed here (mixprec's ``"jsonl"`` among them), one name a list of it; each name is checked."""
        value = self.report_to
        if value is None or value in ("none", ["none"]):
            value = []
        elif value in ("all", ["all"]):
            from mixprec.tracking.registry import installed_tracker_names

            value = ["jsonl", *installed_tracker_names()]
        elif isinstance(value, (str, enum.Enum)):
            value = [value]
        self.report_to = [_plain(r) for r in value]
        if _in_kubeflow_trainjob() and "kubeflow" not in self.report_to:  # transformers turns it on there too
            self.report_to.append("kubeflow")
        for r in self.report_to:
            if r in _NOT_INTEGRATED:
                raise ValueError(f"report_to={r!r}: that integration is not part of mixprec; choose among "
                                 f"{', '.join(map(repr, _reporter_names()))}, or add a TrainerCallback that logs to it")
            _one_of("report_to", r, _reporter_names())

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
        for name, strategy in (("logging_steps", self.logging_strategy), ("save_steps", self.save_strategy),
                               ("eval_steps", self.eval_strategy)):
            if strategy == "steps":  # (as transformers: a value no strategy uses is not checked)
                self._check_steps(name)
        steps = self.torch_empty_cache_steps
        if steps is not None and not (isinstance(steps, int) and steps > 0):
            raise ValueError(f"torch_empty_cache_steps must be an int >= 1 (or None: never), got {steps!r}")
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

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints and models: the main process of each machine
        (``save_on_each_node``), else the main process of the run."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    def get_process_log_level(self) -> int:
        """The ``logging`` level of this process: ``log_level`` where it logs (:attr:`should_log`),
        ``log_level_replica`` elsewhere; ``"passive"`` is transformers' verbosity as it is (the
        ``mixprec`` logger's level without transformers)."""
        level = _LOG_LEVELS[self.log_level if self.should_log else self.log_level_replica]
        return get_verbosity() if level == -1 else level

    @property
    def parallel_mode(self) -> enum.Enum:
        """How the processes are arranged, a member of transformers' ``ParallelMode`` (of
        :class:`ParallelMode` without transformers): ``DISTRIBUTED`` with several processes
        (torchrun's ``WORLD_SIZE`` > 1), else ``NOT_PARALLEL`` (mixprec never drives several GPUs
        from one process, transformers' ``NOT_DISTRIBUTED``)."""
        modes = _parallel_modes()
        return modes.DISTRIBUTED if self.world_size > 1 else modes.NOT_PARALLEL

    @property
    def ddp_timeout_delta(self) -> datetime.timedelta:
        """``ddp_timeout`` as the ``timedelta`` ``torch.distributed.init_process_group`` takes."""
        return datetime.timedelta(seconds=self.ddp_timeout)

    @property
    def place_model_on_device(self) -> bool | None:
        """``None``, as transformers' (a hook subclasses override; the Trainer places the model itself)."""
        return None

    @property
    def deepspeed_plugin(self) -> None:
        """Always ``None``: mixprec does not run DeepSpeed (``deepspeed`` is refused)."""
        return None

    @property
    def mixed_precision(self) -> str:
        """The run's precision in Accelerate's words, as transformers sets it: ``"fp16"`` with
        ``fp16``, ``"bf16"`` with ``bf16``, else what ``accelerate launch --mixed_precision`` set
        (``ACCELERATE_MIXED_PRECISION``), else ``"no"``; mixprec's ``precision`` by its name
        (``"bf16-true"``, ``"fp8"``) where Accelerate has none."""
        if self.precision is not None:
            canon = canonical_precision(self.precision)
            return _ACCELERATE_PRECISION.get(canon, canon)
        if self.fp16 or self.bf16:
            return "fp16" if self.fp16 else "bf16"
        return os.environ.get("ACCELERATE_MIXED_PRECISION", "no")

    @property
    def distributed_state(self) -> Any:
        """This process among the run's, as an Accelerate-compatible state (``num_processes``,
        ``process_index``, ``is_main_process``, ``wait_for_everyone()``, ...), built on each read
        (no process-wide singleton). With several processes the first read starts the process
        group (``ddp_backend``, ``ddp_timeout``), as transformers does when its arguments are built."""
        from mixprec.accelerator.processes import Processes
        from mixprec.accelerator.state import AcceleratorState

        return AcceleratorState(Processes(self._process_group(), self.device), mixed_precision=self.mixed_precision)

    def _process_group(self) -> Any:
        """torchrun's ranks, with the process group started if several processes run and none is yet."""
        from mixprec.distributed import groups

        return groups.init_from_env(self.device.type, timeout_s=self.ddp_timeout, backend=self.ddp_backend)

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the body on the main process first while the others wait, then on the others (e.g.
        ``dataset.map`` in transformers' example scripts: the main process writes the cache, the
        others read it). One process runs the body at once. Syncs: two barriers across processes.

        Args:
            local: the main process of each machine goes first (``False``: only the run's main
                process; with a filesystem every machine shares).
            desc: what the body does, for the debug log.
        """
        if self.world_size <= 1:
            yield
            return
        from mixprec.distributed import groups

        self._process_group()
        first = (self.local_process_index if local else self.process_index) == 0
        log = logging.getLogger(__name__)
        try:
            if not first:
                log.debug("%d: waiting for the main%s process to perform %s", self.process_index,
                          " local" if local else "", desc)
                groups.barrier()
            yield
        finally:
            if first:
                log.debug("%d: main process completed %s, releasing all replicas", self.process_index, desc)
                groups.barrier()

    @property
    def should_checkpoint_activations(self) -> bool:
        """``activation_checkpointing`` (or its old name ``gradient_checkpointing`` where it is unset)."""
        new = self.activation_checkpointing
        return bool(self.gradient_checkpointing if new is None else new)

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
        """The precision name the run uses: ``precision``, else from ``fp16``/``bf16``, else what
        ``accelerate launch --mixed_precision`` set (as transformers' Trainer takes it from
        :attr:`mixed_precision`), else ``"fp32"``."""
        if self.precision is not None:
            return self.precision
        if self.fp16 or self.bf16:
            return "fp16-mixed" if self.fp16 else "bf16-mixed"
        return canonical_precision(self.mixed_precision)

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
        if isinstance(value, type):  # the class itself, not an instance of it (transformers' error)
            raise NotImplementedError("Tried passing in a callable to `accelerator_config`, but this is not supported. "
                                      "Please pass in a fully constructed `AcceleratorConfig` object instead "
                                      f"({value.__name__}(...)), or a dict of its fields.")
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
        group = InitProcessGroupKwargs(backend=self.ddp_backend, timeout=self.ddp_timeout_delta)
        return ([DistributedDataParallelKwargs(**ddp)] if ddp else []) + [group]

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warm-up steps, by transformers' rule: ``warmup_steps`` if it is 1 or more, else that
        fraction of ``num_training_steps`` rounded up (mixprec's ``warmup_ratio`` where
        ``warmup_steps`` is 0)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * (self.warmup_steps or self.warmup_ratio))

    def warmup_for(self, total_steps: int) -> int:
        """:meth:`get_warmup_steps` (mixprec's older name)."""
        return self.get_warmup_steps(total_steps)

    # -- transformers' grouped setters: the same parameters and defaults, the same fields set ----
    # (checked again by validate() when the Trainer starts, so a chain of them may pass through
    # combinations that only the last call makes consistent, as in transformers)
    def set_training(self, learning_rate: float = 5e-5, batch_size: int = 8, weight_decay: float = 0,
                     num_epochs: float = 3, max_steps: int = -1, gradient_accumulation_steps: int = 1, seed: int = 42,
                     activation_checkpointing: bool = False, gradient_checkpointing: bool | None = None,
                     ) -> TrainingArguments:
        """Set the training fields (and ``do_train=True``); returns ``self``.

        Args:
            batch_size: ``per_device_train_batch_size``.
            num_epochs: ``num_train_epochs``.
            gradient_checkpointing: deprecated name of ``activation_checkpointing`` (a ``FutureWarning``).

        Example:
            >>> TrainingArguments("out").set_training(learning_rate=1e-4, batch_size=32).per_device_train_batch_size
            32
        """
        self.do_train = True
        self.learning_rate, self.per_device_train_batch_size, self.weight_decay = learning_rate, batch_size, weight_decay
        self.num_train_epochs, self.max_steps, self.seed = num_epochs, max_steps, seed
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if gradient_checkpointing is not None:
            warnings.warn("`gradient_checkpointing` is deprecated and will be removed in transformers v6; use "
                          "`activation_checkpointing` instead", FutureWarning, stacklevel=2)
            activation_checkpointing = gradient_checkpointing
        self.activation_checkpointing = self.gradient_checkpointing = activation_checkpointing
        return self

    def set_evaluate(self, strategy: str = "no", steps: int = 500, batch_size: int = 8,
                     accumulation_steps: int | None = None, delay: float | None = None,
                     loss_only: bool = False) -> TrainingArguments:
        """Set the evaluation fields (``eval_strategy``, ``eval_steps``, ``per_device_eval_batch_size``,
        ``eval_accumulation_steps``, ``eval_delay``, ``prediction_loss_only``; ``do_eval`` when
        evaluating); returns ``self``.

        Raises:
            ValueError: an unknown strategy, or ``"steps"`` with ``steps=0``.
        """
        self.eval_strategy = _check_strategy("eval_strategy", strategy, steps, _STRATEGIES)
        self.do_eval = self.eval_strategy != "no"
        self.eval_steps, self.per_device_eval_batch_size = steps, batch_size
        self.eval_accumulation_steps, self.eval_delay, self.prediction_loss_only = accumulation_steps, delay, loss_only
        return self

    def set_testing(self, batch_size: int = 8, loss_only: bool = False) -> TrainingArguments:
        """Set ``per_device_eval_batch_size`` and ``prediction_loss_only`` (and ``do_predict=True``); returns ``self``."""
        self.do_predict = True
        self.per_device_eval_batch_size, self.prediction_loss_only = batch_size, loss_only
        return self

    def set_save(self, strategy: str = "steps", steps: int = 500, total_limit: int | None = None,
                 on_each_node: bool = False) -> TrainingArguments:
        """Set ``save_strategy``, ``save_steps``, ``save_total_limit`` and ``save_on_each_node``; returns ``self``.

        Raises:
            ValueError: an unknown strategy, or ``"steps"`` with ``steps=0``.
        """
        self.save_strategy = _check_strategy("save_strategy", strategy, steps, (*_STRATEGIES, "best"))
        self.save_steps, self.save_total_limit, self.save_on_each_node = steps, total_limit, on_each_node
        return self

    def set_logging(self, strategy: str = "steps", steps: int = 500, report_to: str | list[str] = "none",
                    level: str = "passive", first_step: bool = False, nan_inf_filter: bool = False,
                    on_each_node: bool = False, replica_level: str = "passive") -> TrainingArguments:
        """Set ``logging_strategy``, ``logging_steps``, ``report_to``, ``log_level``,
        ``logging_first_step``, ``logging_nan_inf_filter``, ``log_on_each_node`` and
        ``log_level_replica`` (transformers' defaults, ``nan_inf_filter=False`` among them); returns ``self``.

        Raises:
            ValueError: an unknown strategy, or ``"steps"`` with ``steps=0``.
        """
        self.logging_strategy = _check_strategy("logging_strategy", strategy, steps, _STRATEGIES)
        self.logging_steps, self.report_to, self.log_level = steps, report_to, level
        self.logging_first_step, self.logging_nan_inf_filter = first_step, nan_inf_filter
        self.log_on_each_node, self.log_level_replica = on_each_node, replica_level
        return self

    def set_push_to_hub(self, model_id: str, strategy: str = "every_save", token: str | None = None,
                        private_repo: bool | None = None, always_push: bool = False,
                        revision: str | None = None) -> TrainingArguments:
        """transformers' Hub settings, refused: mixprec does not upload (``push_to_hub`` stays ``False``).

        Raises:
            ValueError: always, saying what to do instead.
        """
        raise ValueError(f"set_push_to_hub({model_id!r}): push_to_hub=True is not supported by mixprec's Trainer "
                         f"({_UNSUPPORTED['push_to_hub']}); leave push_to_hub at its default False")

    def set_optimizer(self, name: str = "adamw_torch", learning_rate: float = 5e-5, weight_decay: float = 0,
                      beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
                      args: str | None = None) -> TrainingArguments:
        """Set ``optim``, ``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``,
        ``adam_epsilon`` and ``optim_args``; returns ``self``.

        Raises:
            ValueError: an optimizer name transformers does not know (the message lists them).
        """
        _one_of("optim", _plain(name), optimizer_names(_plain(name)))
        self.optim, self.learning_rate, self.weight_decay = _plain(name), learning_rate, weight_decay
        self.adam_beta1, self.adam_beta2, self.adam_epsilon, self.optim_args = beta1, beta2, epsilon, args
        return self

    def set_lr_scheduler(self, name: str = "linear", num_epochs: float = 3.0, max_steps: int = -1,
                         warmup_steps: float = 0) -> TrainingArguments:
        """Set ``lr_scheduler_type``, ``num_train_epochs``, ``max_steps`` and ``warmup_steps``; returns ``self``.

        Raises:
            ValueError: a scheduler name transformers does not know (the message lists them).
        """
        _one_of("lr_scheduler_type", _plain(name), SCHEDULER_TYPES)
        self.lr_scheduler_type, self.num_train_epochs = _plain(name), num_epochs
        self.max_steps, self.warmup_steps = max_steps, warmup_steps
        return self

    def set_dataloader(self, train_batch_size: int = 8, eval_batch_size: int = 8, drop_last: bool = False,
                       num_workers: int = 0, pin_memory: bool = True, persistent_workers: bool = False,
                       prefetch_factor: int | None = None, multiprocessing_context: str | None = None,
                       in_order: bool = True, auto_find_batch_size: bool = False, ignore_data_skip: bool = False,
                       sampler_seed: int | None = None) -> TrainingArguments:
        """Set the dataloader fields (``per_device_*_batch_size``, ``dataloader_*``,
        ``auto_find_batch_size``, ``ignore_data_skip``, and ``data_seed`` from ``sampler_seed``); returns ``self``."""
        self.per_device_train_batch_size, self.per_device_eval_batch_size = train_batch_size, eval_batch_size
        self.dataloader_drop_last, self.dataloader_num_workers = drop_last, num_workers
        self.dataloader_pin_memory, self.dataloader_persistent_workers = pin_memory, persistent_workers
        self.dataloader_prefetch_factor, self.dataloader_multiprocessing_context = prefetch_factor, multiprocessing_context
        self.dataloader_in_order, self.auto_find_batch_size = in_order, auto_find_batch_size
        self.ignore_data_skip, self.data_seed = ignore_data_skip, sampler_seed
        return self

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
    # Every key with or without "fsdp_", as transformers reads fsdp_config ("fsdp_version" is its "version").
    config = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in (fsdp_config or {}).items()}
    if "shard_grad_op" in options:
        config.setdefault("reshard_after_forward", False)
    return FullyShardedDataParallelPlugin.from_config(config)

"""TrainingArguments: the Hugging Face names and meanings, validated when built."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from ..precision import BF16TrueConfig, canonical_precision

__all__ = ["TrainingArguments"]

_STRATEGIES = ("no", "steps", "epoch")
_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")
_REPORTERS = ("none", "jsonl", "tensorboard", "all")


def _one_of(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of: {', '.join(map(repr, choices))}")


@dataclass(frozen=True, kw_only=True)
class TrainingArguments:
    """What a :class:`~mixprec.Trainer` run does, with Hugging Face's names, defaults and meanings.

    Beyond Hugging Face: ``precision`` takes any name :func:`~mixprec.resolve_precision` accepts
    (``fp16=True`` means ``"fp16-mixed"``, ``bf16=True`` means ``"bf16-mixed"``), and
    ``loss_scaler`` takes :class:`~mixprec.LossScaler` keyword arguments. The precision
    diagnostics: ``diagnostics_steps`` (gradient statistics every N steps, logged), ``trace_overflow``
    (name the first overflowing module), ``drift_steps`` (every N steps the batch's loss in fp32
    beside the mixed one); ``on_loss_scale_collapse="fallback"`` switches a collapsing fp16 run to
    bf16-mixed (or fp32) instead of raising. With ``precision="bf16-true"``,
    ``bf16_true_compensation`` (``"kahan"``, ``"stochastic"``, ``"none"``) and
    ``bf16_true_state_dtype`` (``"fp32"``, ``"bf16"``: the moments, half the optimizer memory) are
    the Accelerator's arguments of the same names. The old spelling
    ``evaluation_strategy`` is accepted with a ``FutureWarning``. The object is frozen: use
    :meth:`replace` for a changed copy (validated again).

    Example:
        >>> args = TrainingArguments(output_dir="out", eval_strategy="epoch", bf16=True)
        >>> args.resolved_precision
        'bf16-mixed'
    """

    output_dir: str = "trainer_output"
    eval_strategy: str = "no"
    eval_steps: int | None = None
    save_strategy: str = "steps"
    save_steps: int = 500
    save_total_limit: int | None = None
    logging_strategy: str = "steps"
    logging_steps: int = 500
    logging_first_step: bool = False
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0
    optim: str = "adamw_torch"
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    seed: int = 42
    data_seed: int | None = None
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    remove_unused_columns: bool = True
    label_names: list[str] | None = None
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    report_to: str | list[str] = "jsonl"
    disable_tqdm: bool = False
    resume_from_checkpoint: str | None = None
    torch_compile: bool = False
    use_cpu: bool = False
    precision: str | None = None
    loss_scaler: dict[str, Any] | None = field(default=None)
    on_loss_scale_collapse: str = "raise"
    bf16_true_compensation: str = "kahan"
    bf16_true_state_dtype: str = "fp32"
    diagnostics_steps: int = 0
    trace_overflow: bool = False
    drift_steps: int = 0
    evaluation_strategy: InitVar[str | None] = None

    def __post_init__(self, evaluation_strategy: str | None) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 - frozen: validated normalisation only
        if evaluation_strategy is not None:
            warnings.warn("`evaluation_strategy` is deprecated; use `eval_strategy` (same values)", FutureWarning, stacklevel=3)
            if self.eval_strategy not in ("no", evaluation_strategy):
                raise ValueError(f"evaluation_strategy={evaluation_strategy!r} and eval_strategy={self.eval_strategy!r} "
                                 "disagree; pass only eval_strategy")
            set_("eval_strategy", evaluation_strategy)
        for name in ("eval_strategy", "save_strategy", "logging_strategy"):
            _one_of(name, getattr(self, name), _STRATEGIES)
        _one_of("optim", self.optim, _OPTIMIZERS)
        _one_of("on_loss_scale_collapse", self.on_loss_scale_collapse, ("raise", "fallback"))
        self.bf16_true  # noqa: B018 - validates bf16_true_compensation and bf16_true_state_dtype
        for name in ("diagnostics_steps", "drift_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0 (0 switches it off), got {v!r}")
        _one_of("lr_scheduler_type", self.lr_scheduler_type, _SCHEDULERS)
        reporters = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        for r in reporters:
            _one_of("report_to", r, _REPORTERS)
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
            set_("eval_steps", self.logging_steps)
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ValueError("load_best_model_at_end=True needs evaluation: set eval_strategy to 'steps' or 'epoch'")
            if self.save_strategy != self.eval_strategy:
                raise ValueError(f"load_best_model_at_end=True needs save_strategy and eval_strategy to match, got "
                                 f"save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}; set both "
                                 "to the same value")
            if self.eval_strategy == "steps" and self.save_steps % self.eval_steps != 0:
                raise ValueError(f"load_best_model_at_end=True needs save_steps ({self.save_steps}) to be a multiple of "
                                 f"eval_steps ({self.eval_steps}), so every checkpoint has an evaluation")
            if self.metric_for_best_model is None:
                set_("metric_for_best_model", "loss")
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            set_("greater_is_better", not self.metric_for_best_model.endswith("loss"))
        if self.label_names is not None:
            set_("label_names", list(self.label_names))

    def _check_numbers(self) -> None:
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "logging_steps", "save_steps"):
            positive_int(name)
        positive_int("eval_steps", allow_none=True)
        positive_int("save_total_limit", allow_none=True)
        if not isinstance(self.max_steps, int) or self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps must be -1 (use num_train_epochs) or an int >= 1, got {self.max_steps!r}")
        if not (isinstance(self.num_train_epochs, (int, float)) and math.isfinite(self.num_train_epochs)
                and self.num_train_epochs > 0):
            raise ValueError(f"num_train_epochs must be a number > 0, got {self.num_train_epochs!r}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate >= 0):
            raise ValueError(f"learning_rate must be a number >= 0, got {self.learning_rate!r}")
        if not (0.0 <= self.warmup_ratio < 1.0):
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.warmup_steps < 0 or self.dataloader_num_workers < 0:
            raise ValueError("warmup_steps and dataloader_num_workers must be >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 or None: no clipping), got {self.max_grad_norm!r}")

    # -- derived ---------------------------------------------------------------------------
    @property
    def bf16_true(self) -> BF16TrueConfig:
        """bf16-true's optimizer options, validated (``bf16_true_compensation``, ``bf16_true_state_dtype``)."""
        return BF16TrueConfig(compensation=self.bf16_true_compensation, state_dtype=self.bf16_true_state_dtype)

    @property
    def resolved_precision(self) -> str:
        """The precision name the run uses: ``precision``, else from ``fp16``/``bf16``, else ``"fp32"``."""
        if self.precision is not None:
            return self.precision
        return "fp16-mixed" if self.fp16 else "bf16-mixed" if self.bf16 else "fp32"

    @property
    def reporters(self) -> set[str]:
        """The loggers asked for, with ``"all"`` expanded."""
        asked = {self.report_to} if isinstance(self.report_to, str) else set(self.report_to)
        if "all" in asked:
            return {"jsonl", "tensorboard"}
        return asked - {"none"}

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps: ``warmup_steps`` if set, else ``warmup_ratio`` of ``total_steps``."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(total_steps * self.warmup_ratio)

    # -- serialisation ---------------------------------------------------------------------
    def replace(self, **changes: Any) -> TrainingArguments:
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (JSON- and TOML-ready)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` as JSON."""
        Path(path).write_text(self.to_json_string() + "\n")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)] + ["evaluation_strategy"]

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "the arguments") -> TrainingArguments:
        """Build from a dict, refusing unknown keys with the list of valid ones."""
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

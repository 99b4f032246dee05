"""Where a Trainer run stands (:class:`TrainerState`) and what its callbacks ask (:class:`TrainerControl`).

Both are Hugging Face's, field for field, so that ``trainer_state.json`` is the file Hugging Face's
tools read; :class:`ExportableState` is Hugging Face's protocol for what a checkpoint keeps of a
callback.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrainerState", "TrainerControl", "ExportableState", "export_states", "is_exportable"]

# mixprec's own bookkeeping in TrainerState: saved beside trainer_state.json (in
# mixprec_trainer_state.json), so that Hugging Face's TrainerState.load_from_json reads the file.
MIXPREC_STATE_FIELDS = ("skipped_steps", "loss_scale", "precision", "total_loss", "loss_since_log", "steps_since_log",
                        "skipped_steps_since_log")


@dataclass
class TrainerState:
    """Where training stands; saved as ``trainer_state.json`` in every checkpoint.

    Hugging Face's fields (``global_step``, ``epoch``, ``max_steps``, ``log_history``,
    ``best_metric``, ``best_model_checkpoint``, ``stateful_callbacks``, ...) plus mixprec's
    ``skipped_steps`` (optimizer steps skipped for inf/NaN gradients) and ``loss_scale`` (the
    current fp16 loss scale). ``trainer_state.json`` holds Hugging Face's fields only (its
    ``TrainerState.load_from_json`` reads it); :meth:`mixprec_json_string` holds the rest.
    """

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: float = 500
    eval_steps: float = 500
    save_steps: float = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0
    loss_scale: float | None = None
    precision: str = "fp32"
    # The loss bookkeeping between logs, so that a resumed run logs what the uninterrupted one would.
    total_loss: float = 0.0
    loss_since_log: float = 0.0
    steps_since_log: int = 0
    skipped_steps_since_log: list[int] = field(default_factory=list)  # their numbers, for the next log

    def compute_steps(self, args: Any, max_steps: int) -> None:
        """``logging_steps``, ``eval_steps``, ``save_steps`` from ``args``, fractions below 1 of ``max_steps``."""
        for kind in ("logging", "eval", "save"):
            n = getattr(args, f"{kind}_steps")
            if n is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * n) if n < 1 else n)

    def init_training_references(self, trainer: Any, max_steps: int, num_train_epochs: int, trial: Any) -> None:
        """Record the run's length and the trainer's process roles, as transformers' method of this
        name does at the start of ``train()`` (``trial_params``: the hyperparameter trial's, if any)."""
        self.trial_params = dict(getattr(trial, "params", None) or {}) or None if trial is not None else None
        self.max_steps = max_steps
        self.num_train_epochs = num_train_epochs
        self.is_local_process_zero = trainer.is_local_process_zero()
        self.is_world_process_zero = trainer.is_world_process_zero()

    def to_json_string(self) -> str:
        """Hugging Face's fields as JSON (what ``trainer_state.json`` holds)."""
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in MIXPREC_STATE_FIELDS}
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def mixprec_json_string(self) -> str:
        """mixprec's own fields as JSON (``mixprec_trainer_state.json`` beside ``trainer_state.json``)."""
        return json.dumps({k: getattr(self, k) for k in MIXPREC_STATE_FIELDS}, indent=2, sort_keys=True) + "\n"

    def save_to_json(self, json_path: str | Path) -> None:
        """Write :meth:`to_json_string` to ``json_path``."""
        Path(json_path).write_text(self.to_json_string())

    @classmethod
    def load_from_json(cls, json_path: str | Path) -> TrainerState:
        """Read ``trainer_state.json`` (and ``mixprec_trainer_state.json`` beside it, where present)."""
        path = Path(json_path)
        data = json.loads(path.read_text())
        extra = path.with_name("mixprec_trainer_state.json")
        if extra.is_file():
            data.update(json.loads(extra.read_text()))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


class ExportableState:
    """A callback (or the control) whose settings a checkpoint keeps (Hugging Face's protocol).

    :meth:`state` returns ``{"args": ..., "attributes": ...}``: the object is rebuilt as
    ``type(obj)(**args)`` with ``attributes`` set on it when a run resumes with
    ``restore_callback_states_from_checkpoint=True``. Any callback with such a ``state()``
    method qualifies (Hugging Face's own callbacks too).
    """

    def state(self) -> dict[str, Any]:
        raise NotImplementedError("an ExportableState must implement state()")

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Any:
        """The object :meth:`state` describes."""
        obj = cls(**state.get("args", {}))
        for k, v in state.get("attributes", {}).items():
            setattr(obj, k, v)
        return obj


def is_exportable(obj: Any) -> bool:
    """Whether ``obj`` has ``state()`` in Hugging Face's sense (mixprec's or transformers' ExportableState)."""
    return isinstance(obj, ExportableState) or any(c.__name__ == "ExportableState" for c in type(obj).__mro__)


def export_states(objects: list[Any]) -> dict[str, Any]:
    """``{class name: state()}`` of the exportable ``objects`` (a list where a class has several)."""
    out: dict[str, Any] = {}
    for obj in objects:
        if not is_exportable(obj):
            continue
        name, st = type(obj).__name__, obj.state()
        if name in out:
            out[name] = (out[name] if isinstance(out[name], list) else [out[name]]) + [st]
        else:
            out[name] = st
    return out


@dataclass
class TrainerControl(ExportableState):
    """What the callbacks ask the loop to do next.

    As in Hugging Face: ``should_training_stop`` is cleared when training begins,
    ``should_epoch_stop`` when an epoch begins, ``should_log``/``should_evaluate``/``should_save``
    when a step begins and when that log, evaluation or save has happened.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False

    def state(self) -> dict[str, Any]:
        """The flags, for the checkpoint."""
        return {"args": dataclasses.asdict(self), "attributes": {}}

"""Run configurations for ``mixprec train``: a TOML file plus ``--flags``, checked before any work.

A config has four tables::

    [task]          name = "pycode" | "digits", size (pycode), arch (digits), max_bytes / eval_max_bytes
                    (pycode: text read per split); or model = "pkg.mod:factory", data = "pkg.mod:factory"
    [training]      any TrainingArguments field
    [precision]     name = "auto" | "bf16" | ...; loss_scaler = { init_scale = 65536.0, ... }
    [diagnostics]   steps, trace_overflow, drift_steps

Flags override the file: ``--section.key VALUE`` for any key, or ``--key VALUE`` for a
``[training]`` field (``--max-steps 10`` works too) and for ``--task``, ``--size``, ``--arch``,
``--model``, ``--data``, ``--precision``. Values are read as TOML (``10`` is an int, ``true`` a
bool, ``1e-3`` a float); anything else is a string. Every mistake is a :class:`ConfigError` that
names the key, the file and line where there is one, and the valid choices.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..precision import canonical_precision
from ..trainer.args import TrainingArguments

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_overrides"]

_TASK_KEYS = {"name": str, "size": str, "arch": str, "model": str, "data": str, "max_bytes": int, "eval_max_bytes": int}
_PRECISION_KEYS = {"name": str, "loss_scaler": dict}
_DIAGNOSTICS_KEYS = {"steps": int, "trace_overflow": bool, "drift_steps": int}
_SHORT_FLAGS = {"task": ("task", "name"), "size": ("task", "size"), "arch": ("task", "arch"),
                "model": ("task", "model"), "data": ("task", "data"), "precision": ("precision", "name")}
_TASKS = {"pycode": ("size", ("tiny", "mini", "small")), "digits": ("arch", ("mlp", "cnn"))}


class ConfigError(ValueError):
    """A configuration mistake, with where it is and how to fix it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A checked run configuration: what ``mixprec train`` runs."""

    task: dict[str, Any]
    training: TrainingArguments
    diagnostics: dict[str, Any]
    source: str = "<flags>"


def _training_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainingArguments, include_extras=False)
    types_ = {f.name: hints[f.name] for f in dataclasses.fields(TrainingArguments)}
    types_["evaluation_strategy"] = str  # Hugging Face's old spelling (warns)
    return types_


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    text = str(hint).replace("typing.", "")
    return re.sub(r"<class '(\w+)'>", r"\1", text)


def _line_of(text: str, section: str, key: str) -> int | None:
    """The line of ``key = ...`` inside ``[section]`` (or of the section header), 1-based."""
    current, header_line = "", None
    for i, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        m = re.match(r"^\[\s*([^\]]+?)\s*\]", stripped)
        if m:
            current = m.group(1)
            if current == section:
                header_line = i
            continue
        if current == section and re.match(rf"^\s*{re.escape(key)}\s*=", line):
            return i
    return header_line


class _Where:
    def __init__(self, path: str | None, text: str) -> None:
        self.path, self.text = path, text

    def __call__(self, section: str, key: str | None = None, flag: bool = False) -> str:
        name = f"[{section}] {key}" if key else f"[{section}]"
        if flag or self.path is None:
            return f"{name} (from the command line)"
        line = _line_of(self.text, section, key or "") if key else _line_of(self.text, section, "\0")
        return f"{self.path}:{line}: {name}" if line else f"{self.path}: {name}"


def parse_overrides(flags: list[str]) -> dict[str, dict[str, Any]]:
    """``["--max-steps", "10", "--precision.name", "bf16"]`` as ``{"training": {"max_steps": 10}, ...}``.

    Raises:
        ConfigError: for a flag without a value, a value without a flag, or an unknown flag.
    """
    out: dict[str, dict[str, Any]] = {}
    training = set(TrainingArguments.field_names())
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--") or len(flag) <= 2:
            raise ConfigError(f"unexpected argument {flag!r}: options are --key VALUE (e.g. --max-steps 10)")
        name, _, inline = flag[2:].partition("=")
        if inline == "" and "=" not in flag[2:]:
            if i + 1 >= len(flags):
                raise ConfigError(f"{flag} needs a value, e.g. {flag} 10")
            value_text, i = flags[i + 1], i + 2
        else:
            value_text, i = inline, i + 1
        key = name.replace("-", "_")
        if "." in key:
            section, _, key = key.partition(".")
        elif key in _SHORT_FLAGS:
            section, key = _SHORT_FLAGS[key]
        elif key in training:
            section = "training"
        else:
            raise ConfigError(f"unknown option --{name}; use --section.key VALUE, a TrainingArguments field "
                              f"(--max-steps, --learning-rate, ...) or one of "
                              f"{', '.join('--' + k for k in _SHORT_FLAGS)}")
        out.setdefault(section, {})[key] = _parse_value(value_text)
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None, flags: list[str] | None = None) -> RunConfig:
    """Read, merge and check a run configuration (``path`` may be ``None``: flags only).

    Raises:
        ConfigError: naming the key, the file and line, and the valid choices.
    """
    text, doc = "", {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} does not exist; pass a TOML file (see examples/)")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
    where = _Where(str(path) if path is not None else None, text)
    overrides = parse_overrides(flags or [])
    valid_sections = ("task", "training", "precision", "diagnostics")
    for section in list(doc) + list(overrides):
        if section not in valid_sections:
            raise ConfigError(f"{where(section, flag=section not in doc)}: unknown table; valid tables: "
                              f"{', '.join(f'[{s}]' for s in valid_sections)}")
    merged: dict[str, dict[str, Any]] = {}
    for section in valid_sections:
        table = doc.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where(section)}: must be a table ([{section}] with key = value lines)")
        merged[section] = {**table, **overrides.get(section, {})}

    def check_keys(section: str, schema: dict[str, Any]) -> None:
        for key, value in merged[section].items():
            from_flag = key in overrides.get(section, {})
            if key not in schema:
                raise ConfigError(f"{where(section, key, from_flag)}: unknown key; valid keys: {', '.join(schema)}")
            if not _type_ok(value, schema[key]):
                raise ConfigError(f"{where(section, key, from_flag)}: expected {_type_name(schema[key])}, "
                                  f"got {type(value).__name__} {value!r}")

    check_keys("task", _TASK_KEYS)
    check_keys("precision", _PRECISION_KEYS)
    check_keys("diagnostics", _DIAGNOSTICS_KEYS)
    check_keys("training", _training_types())
    task = _check_task(merged["task"], where, overrides.get("task", {}))
    training = dict(merged["training"])
    prec = merged["precision"]
    if "name" in prec:
        try:
            canonical_precision(prec["name"])
        except ValueError as e:
            raise ConfigError(f"{where('precision', 'name', 'name' in overrides.get('precision', {}))}: {e}") from None
        training["precision"] = prec["name"]
    if "loss_scaler" in prec:
        training["loss_scaler"] = prec["loss_scaler"]
    resume = training.get("resume_from_checkpoint")
    if isinstance(resume, str) and not Path(resume).exists():
        raise ConfigError(f"{where('training', 'resume_from_checkpoint', 'resume_from_checkpoint' in overrides.get('training', {}))}: "
                          f"{resume} does not exist; give a checkpoint folder, or use --resume for the newest one")
    try:
        args = TrainingArguments(**training)
    except (ValueError, TypeError) as e:
        key = next((k for k in training if k in str(e)), None)
        place = where("training", key, key in overrides.get("training", {})) if key else where("training")
        raise ConfigError(f"{place}: {e}") from None
    return RunConfig(task=task, training=args, diagnostics=merged["diagnostics"], source=str(path or "<flags>"))


def _check_task(task: dict[str, Any], where: _Where, flags: dict[str, Any]) -> dict[str, Any]:
    user = {"model", "data"} & set(task)
    if user:
        if user != {"model", "data"}:
            missing = ({"model", "data"} - user).pop()
            raise ConfigError(f"{where('task', missing, True)}: a user task needs both model and data "
                              "(module:factory each)")
        for key in ("model", "data"):
            if not re.fullmatch(r"[\w.]+:[\w.]+", task[key]):
                raise ConfigError(f"{where('task', key, key in flags)}: {task[key]!r} is not package.module:factory")
        return task
    name = task.get("name")
    if name is None:
        raise ConfigError(f"{where('task')}: say which task: name = {' | '.join(map(repr, _TASKS))}, "
                          "or model = 'pkg.mod:factory' and data = 'pkg.mod:factory'")
    if name not in _TASKS:
        raise ConfigError(f"{where('task', 'name', 'name' in flags)}: unknown task {name!r}; valid tasks: "
                          f"{', '.join(_TASKS)} (or model/data factories)")
    option, choices = _TASKS[name]
    other = ({"size", "arch"} - {option}) | ({"max_bytes", "eval_max_bytes"} if name != "pycode" else set())
    for key in other & set(task):
        raise ConfigError(f"{where('task', key, key in flags)}: the {name} task has no {key}; it takes {option}"
                          + (", max_bytes, eval_max_bytes" if name == "pycode" else ""))
    if option in task and task[option] not in choices:
        raise ConfigError(f"{where('task', option, option in flags)}: unknown {option} {task[option]!r} for "
                          f"{name}; valid: {', '.join(choices)}")
    return task

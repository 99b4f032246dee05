"""Run configurations for ``mixprec train`` (and ``doctor``): a TOML file plus ``--flags``, checked before any work.

One typed run config, :class:`RunConfig`: the task (:class:`TaskConfig`) and the
:class:`~mixprec.TrainingArguments`, the precision included. A TOML file spreads them over four
tables, and each setting has one place::

    [task]          name = "pycode" | "digits" with that task's options (its builder's parameters in
                    mixprec.tasks.TASKS: size, arch, max_bytes, eval_max_bytes, root, seed);
                    or model = "pkg.mod:factory" and data = "pkg.mod:factory"
    [training]      every TrainingArguments field but those of the next two tables
    [precision]     name (TrainingArguments.precision), loss_scaler, bf16_true_compensation,
                    bf16_true_state_dtype, skip_nonfinite_steps, on_loss_scale_collapse
    [diagnostics]   steps (diagnostics_steps), trace_overflow, drift_steps

Flags override the file: ``--table.key VALUE`` for any key; and the flags derived from the fields:
a ``[training]``, ``[precision]`` or ``[diagnostics]`` key is ``--`` the TrainingArguments field it
sets (``--max-steps 10``, ``--precision bf16``, ``--diagnostics-steps 5``); a ``[task]`` key is
``--task`` (the name), ``--model``, ``--data``, or ``--`` the option's name where no
TrainingArguments field has it (``--size``, ``--arch``; digits' split seed is ``--task.seed``).
Values are read as TOML (``10`` is an int, ``true`` a bool, ``1e-3`` a float); anything else is a
string. Every mistake is a :class:`ConfigError` that names the key, the file and line where there
is one, and the valid choices.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from mixprec.precision import canonical_precision
from mixprec.tasks import TASKS, Task, TaskOptionError, check_task, load_task
from mixprec.trainer.args import TrainingArguments

__all__ = ["ConfigError", "RunConfig", "TaskConfig", "load_config", "parse_overrides", "flag_names"]

# The TrainingArguments fields that [precision] and [diagnostics] set, by their key there; [training] sets the rest.
_ROUTED = {
    "precision": {"name": "precision", "loss_scaler": "loss_scaler", "bf16_true_compensation": "bf16_true_compensation",
                  "bf16_true_state_dtype": "bf16_true_state_dtype", "skip_nonfinite_steps": "skip_nonfinite_steps",
                  "on_loss_scale_collapse": "on_loss_scale_collapse"},
    "diagnostics": {"steps": "diagnostics_steps", "trace_overflow": "trace_overflow", "drift_steps": "drift_steps"},
}
# Hugging Face's precision switches: a second spelling of [precision] name, so refused in [training].
_SWITCHES = {"fp16": "fp16-mixed", "bf16": "bf16-mixed"}
_TABLES = ("task", "training", "precision", "diagnostics")
_TASK_SPECS = ("name", "model", "data")


class ConfigError(ValueError):
    """A configuration mistake, with where it is and how to fix it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The ``[task]`` table: a built-in task and its options, or the user's model and data factories.

    Checked when built (nothing is imported or read): see :func:`mixprec.tasks.check_task`.

    Args:
        name: A key of :data:`mixprec.tasks.TASKS`.
        model: ``"package.module:factory"`` of the model; with ``data``.
        data: ``"package.module:factory"`` of the data (:data:`mixprec.tasks.DATA_CONTRACT`).
        options: The built-in task's options (``{"size": "tiny"}``).

    Example:
        >>> TaskConfig(name="digits", options={"arch": "cnn"}).load().name  # doctest: +SKIP
        'digits/cnn'
    """

    name: str | None = None
    model: str | None = None
    data: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_task(self.name, model=self.model, data=self.data, **self.options)

    def load(self) -> Task:
        """Build the task: read the built-in one's data, or import and call the user's factories."""
        return load_task(self.name, model=self.model, data=self.data, **self.options)

    def as_table(self) -> dict[str, Any]:
        """The ``[task]`` table this config reads as."""
        specs = {k: getattr(self, k) for k in _TASK_SPECS if getattr(self, k) is not None}
        return {**specs, **self.options}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A checked run configuration: what ``mixprec train`` runs.

    Args:
        task: What to train.
        training: How: every setting of the run, the precision's and the diagnostics' included.
        source: The config file, or ``"<flags>"``.
    """

    task: TaskConfig
    training: TrainingArguments
    source: str = "<flags>"

    @property
    def precision(self) -> str:
        """The precision name asked for (``[precision] name``; ``"fp32"`` by default)."""
        return self.training.resolved_precision

    @property
    def diagnostics(self) -> dict[str, Any]:
        """The ``[diagnostics]`` table's values, as the TrainingArguments hold them."""
        return {key: getattr(self.training, field) for key, field in _ROUTED["diagnostics"].items()}


def _schemas() -> dict[str, dict[str, Any]]:
    """Each table's keys and their type hints, from TrainingArguments' fields and the task registry."""
    hints = typing.get_type_hints(TrainingArguments)
    ta = {f.name: hints[f.name] for f in dataclasses.fields(TrainingArguments)}
    ta["evaluation_strategy"] = str  # Hugging Face's old spelling (warns)
    routed = {field for keys in _ROUTED.values() for field in keys.values()}
    task = dict.fromkeys(_TASK_SPECS, str)
    for entry in TASKS.values():
        for option, hint in entry.options.items():
            task.setdefault(option, hint)
    return {"task": task, "training": {k: h for k, h in ta.items() if k not in routed},
            **{table: {key: ta[field] for key, field in keys.items()} for table, keys in _ROUTED.items()}}


def flag_names() -> dict[str, tuple[str, str]]:
    """Every short flag's name (``"max_steps"``) and the ``(table, key)`` it sets.

    Example:
        >>> flag_names()["precision"], flag_names()["size"], flag_names()["diagnostics_steps"]
        (('precision', 'name'), ('task', 'size'), ('diagnostics', 'steps'))
    """
    schemas = _schemas()
    flags = {field: (table, key) for table, keys in _ROUTED.items() for key, field in keys.items()}
    flags.update({key: ("training", key) for key in schemas["training"]})
    flags.update({"task": ("task", "name"), "model": ("task", "model"), "data": ("task", "data")})
    for option in schemas["task"]:
        flags.setdefault(option, ("task", option))  # a TrainingArguments field of the same name keeps --name
    return flags


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a field's type hint (dataclasses do not check types themselves)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
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
    return isinstance(value, hint) if isinstance(hint, type) and hint is not Any else True


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
    """Says where a key is: ``file:line: [table] key``, or ``[table] key (from the command line)``."""

    def __init__(self, path: str | None, text: str, overrides: dict[str, dict[str, Any]]) -> None:
        self.path, self.text, self.overrides = path, text, overrides

    def __call__(self, section: str, key: str | None = None) -> str:
        name = f"[{section}] {key}" if key else f"[{section}]"
        from_flag = key in self.overrides.get(section, {}) if key else section in self.overrides
        if from_flag:
            return f"{name} (from the command line)"
        if self.path is None:
            return name
        line = _line_of(self.text, section, key) if key else _line_of(self.text, section, "\0")
        return f"{self.path}:{line}: {name}" if line else f"{self.path}: {name}"


def parse_overrides(flags: list[str]) -> dict[str, dict[str, Any]]:
    """``["--max-steps", "10", "--precision", "bf16"]`` as ``{"training": {"max_steps": 10}, ...}``.

    Raises:
        ConfigError: for a flag without a value, a value without a flag, or an unknown flag.
    """
    out: dict[str, dict[str, Any]] = {}
    short = flag_names()
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
        elif key in short:
            section, key = short[key]
        else:
            task_flags = [f for f, (table, _) in short.items() if table == "task"]
            raise ConfigError(f"unknown option --{name}; use --table.key VALUE, a TrainingArguments field "
                              f"(--max-steps, --learning-rate, --precision, --diagnostics-steps, ...) or one of "
                              f"{', '.join('--' + f.replace('_', '-') for f in task_flags)}")
        out.setdefault(section, {})[key] = _parse_value(value_text)
    return out


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _read(path: str | Path | None) -> tuple[str, dict[str, Any]]:
    if path is None:
        return "", {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a TOML file (see examples/)")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(path: str | Path | None, flags: list[str] | None = None) -> RunConfig:
    """Read, merge and check a run configuration (``path`` may be ``None``: flags only).

    Raises:
        ConfigError: naming the key, the file and line, and the valid choices.

    Example:
        >>> load_config("examples/digits-mlp.toml", ["--max-steps", "5"]).training.max_steps  # doctest: +SKIP
        5
    """
    text, doc = _read(path)
    overrides = parse_overrides(flags or [])
    where = _Where(str(path) if path is not None else None, text, overrides)
    for section in list(doc) + list(overrides):
        if section not in _TABLES:
            raise ConfigError(f"{where(section)}: unknown table; valid tables: {', '.join(f'[{s}]' for s in _TABLES)}")
    merged: dict[str, dict[str, Any]] = {}
    for section in _TABLES:
        table = doc.get(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where(section)}: must be a table ([{section}] with key = value lines)")
        merged[section] = {**_flags_win(section, table, overrides.get(section, {})), **overrides.get(section, {})}
    schemas = _schemas()
    for section in _TABLES:
        _check_keys(section, merged[section], schemas, where)
    task = _task_config(merged["task"], where)
    training = dict(merged["training"])
    for section, keys in _ROUTED.items():
        training.update({keys[k]: v for k, v in merged[section].items()})
    if "precision" in training:
        try:
            canonical_precision(training["precision"])
        except ValueError as e:
            raise ConfigError(f"{where('precision', 'name')}: {e}") from None
    resume = training.get("resume_from_checkpoint")
    if isinstance(resume, str) and not Path(resume).exists():
        raise ConfigError(f"{where('training', 'resume_from_checkpoint')}: {resume} does not exist; give a checkpoint "
                          "folder, or use --resume for the newest one")
    try:
        args = TrainingArguments(**training)
    except (ValueError, TypeError) as e:
        origin = {field: (section, key) for section, keys in _ROUTED.items() for key, field in keys.items()}
        field = next((k for k in training if re.search(rf"\b{k}\b", str(e))), None)
        place = where(*origin.get(field, ("training", field))) if field else where("training")
        raise ConfigError(f"{place}: {e}") from None
    return RunConfig(task=task, training=args, source=str(path or "<flags>"))


def _flags_win(section: str, table: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The file's table less what a flag replaces: ``--model``/``--data`` replace a built-in task, ``--task`` a user's."""
    if section != "task":
        return table
    if {"model", "data"} & set(flags):
        return {k: v for k, v in table.items() if k in ("model", "data")}
    if "name" in flags:
        return {k: v for k, v in table.items() if k not in ("model", "data")}
    return table


def _check_keys(section: str, values: dict[str, Any], schemas: dict[str, dict[str, Any]], where: _Where) -> None:
    schema = schemas[section]
    name = values.get("name") if section == "task" else None
    entry = TASKS.get(name) if isinstance(name, str) else None
    for key, value in values.items():
        if section == "training" and key in _SWITCHES:
            raise ConfigError(f"{where(section, key)}: the precision is set in one place, [precision]: "
                              f"name = \"{_SWITCHES[key]}\" (or --precision {key})")
        owner = next((t for t, keys in _ROUTED.items() if key in keys.values() and section == "training"), None)
        if owner is not None:
            routed = next(k for k, f in _ROUTED[owner].items() if f == key)
            raise ConfigError(f"{where(section, key)}: set it in [{owner}] as {routed} = ... (one place per setting)")
        if key not in schema:
            raise ConfigError(f"{where(section, key)}: unknown key; valid keys: {', '.join(schema)}")
        hint = entry.options.get(key, schema[key]) if entry is not None else schema[key]
        if not _type_ok(value, hint):
            raise ConfigError(f"{where(section, key)}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def _task_config(table: dict[str, Any], where: _Where) -> TaskConfig:
    specs = {k: table[k] for k in _TASK_SPECS if k in table}
    try:
        return TaskConfig(**specs, options={k: v for k, v in table.items() if k not in _TASK_SPECS})
    except TaskOptionError as e:
        raise ConfigError(f"{where('task', e.option if e.option in table else None)}: {e}") from None

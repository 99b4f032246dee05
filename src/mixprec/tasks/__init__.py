"""Built-in training tasks and the one registry of them; a user's own task from two factories.

``get_task("pycode", "mini")`` is a byte-level GPT on the Python standard library's source
(:mod:`mixprec.tasks.pycode`); ``get_task("digits", arch="cnn")`` is scikit-learn's bundled
handwritten digits (:mod:`mixprec.tasks.digits`). :data:`TASKS` is the catalogue: every list of
task names, sizes, architectures and options elsewhere (the CLI's flags and configs, the bench)
is read from it. :func:`load_task` is what ``mixprec train``, ``bench`` and ``doctor`` call: a
built-in task by name, or the user's own from ``model`` and ``data`` factories
(:func:`~mixprec.tasks.user.user_task`). Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from mixprec.data import collate
from mixprec.models import CausalLMOutput, ClassifierOutput, ModelOutput
from mixprec.tasks.digits import DIGITS_ARCHS, DigitsCNN, DigitsDataset, DigitsMLP, accuracy, digits_task
from mixprec.tasks.factory import load_factory, parse_spec
from mixprec.tasks.gpt import GPT, GPTConfig
from mixprec.tasks.pycode import (  # noqa: F401 - the DEFAULT_* and load_pycode_bytes: importable here as before
    DEFAULT_EVAL_MAX_BYTES,
    DEFAULT_MAX_BYTES,
    PYCODE_SIZES,
    ByteBlockDataset,
    bits_per_byte,
    generate_sample,
    load_pycode_bytes,
    pycode_task,
)
from mixprec.tasks.task import Task
from mixprec.tasks.user import DATA_CONTRACT, split_data, user_task

__all__ = [
    "Task",
    "TaskEntry",
    "TaskOptionError",
    "TASKS",
    "get_task",
    "list_tasks",
    "load_task",
    "check_task",
    "user_task",
    "split_data",
    "DATA_CONTRACT",
    "load_factory",
    "parse_spec",
    "GPT",
    "GPTConfig",
    "PYCODE_SIZES",
    "ByteBlockDataset",
    "DigitsDataset",
    "DigitsMLP",
    "DigitsCNN",
    "ModelOutput",
    "CausalLMOutput",
    "ClassifierOutput",
    "collate",
    "accuracy",
    "bits_per_byte",
    "generate_sample",
]


class TaskOptionError(ValueError):
    """A task described wrongly; ``option`` names the key at fault (``"name"``, ``"size"``, ...)."""

    def __init__(self, option: str | None, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskEntry:
    """One built-in task of the registry: its builder, and the choices of its first option.

    The builder's signature is the task's schema: its first parameter (the *variant*, ``size``
    or ``arch``) picks the model among ``variants``; every parameter is an option, with the
    builder's type hint and default.

    Args:
        name: The registry key (``"pycode"``).
        build: ``(variant, **options) -> Task``.
        variants: The values the variant takes, the default among them.
        summary: One line for humans.
    """

    name: str
    build: Callable[..., Task]
    variants: tuple[str, ...]
    summary: str

    @property
    def options(self) -> dict[str, Any]:
        """Every option the builder takes, the variant first, with its type hint."""
        hints = typing.get_type_hints(self.build)
        return {name: hints[name] for name in inspect.signature(self.build).parameters}

    @property
    def defaults(self) -> dict[str, Any]:
        """Each option's default, as the builder's signature has it."""
        return {name: p.default for name, p in inspect.signature(self.build).parameters.items()}

    @property
    def variant(self) -> str:
        """The option that picks the model: ``"size"`` or ``"arch"``."""
        return next(iter(self.options))

    def check(self, options: Mapping[str, Any]) -> None:
        """Check option names and the variant's value, without building anything.

        Raises:
            TaskOptionError: naming the option, the task and the valid choices.
        """
        unknown = [k for k in options if k not in self.options]
        if unknown:
            raise TaskOptionError(unknown[0], f"unknown option(s) {unknown} for the {self.name} task; the options "
                                  f"are {list(self.options)}")
        value = options.get(self.variant)
        if value is not None and value not in self.variants:
            raise TaskOptionError(self.variant, f"unknown {self.name} {self.variant} {value!r}; choose one of "
                                  f"{list(self.variants)}")

    def __call__(self, **options: Any) -> Task:
        """Check the options and build the task (options set to ``None`` take their default)."""
        self.check(options)
        return self.build(**{k: v for k, v in options.items() if v is not None})


TASKS: dict[str, TaskEntry] = {
    "pycode": TaskEntry(name="pycode", build=pycode_task, variants=tuple(PYCODE_SIZES),
                        summary="a byte-level GPT on the Python standard library's source"),
    "digits": TaskEntry(name="digits", build=digits_task, variants=tuple(DIGITS_ARCHS),
                        summary="scikit-learn's bundled 8x8 handwritten digits, an MLP or a CNN"),
}


def list_tasks() -> dict[str, list[str]]:
    """The built-in task names and, for each, its sizes (empty when it has none).

    Example:
        >>> list_tasks()
        {'pycode': ['tiny', 'mini', 'small'], 'digits': []}
    """
    return {name: list(entry.variants) if entry.variant == "size" else [] for name, entry in TASKS.items()}


def _entry(name: Any) -> TaskEntry:
    if not isinstance(name, str) or name not in TASKS:
        raise TaskOptionError("name", f"unknown task {name!r}; the built-in tasks are {list(TASKS)}, or give your "
                              "own model and data factories ('package.module:factory' each)")
    return TASKS[name]


def get_task(name: str, size: str | None = None, **options: Any) -> Task:
    """Build a built-in task.

    Args:
        name: A key of :data:`TASKS`: ``"pycode"`` or ``"digits"``.
        size: For ``pycode``, ``"tiny"`` (tests), ``"mini"`` (default, CPU demo) or ``"small"``;
            ``digits`` has no sizes.
        **options: For ``pycode``: ``max_bytes`` and ``eval_max_bytes`` (bytes of text read per
            split), ``root`` (a directory of ``.py`` files instead of the standard library).
            For ``digits``: ``arch`` (``"mlp"`` or ``"cnn"``) and ``seed`` (of the split).

    Raises:
        TaskOptionError: (a ``ValueError``) naming the unknown task or option and the choices.

    Example:
        >>> task = get_task("pycode", "tiny", max_bytes=20_000, eval_max_bytes=5_000)
        >>> task.name, len(task.train_dataset)
        ('pycode/tiny', 312)
    """
    entry = _entry(name)
    if size is not None:
        if entry.variant != "size":
            raise TaskOptionError("size", f"the {name} task has no sizes, got size={size!r}; leave size out and "
                                  f"choose the model with {entry.variant}= one of {list(entry.variants)}")
        options["size"] = size
    return entry(**options)


def check_task(name: str | None = None, *, model: str | None = None, data: str | None = None,
               **options: Any) -> None:
    """Check what :func:`load_task` would load, without importing or reading anything.

    Raises:
        TaskOptionError: naming the key at fault and the fix.
    """
    if model is None and data is None:
        if name is None:
            raise TaskOptionError("name", f"say which task: name one of {list(TASKS)}, or give model and data "
                                  "('package.module:factory' each)")
        _entry(name).check(options)
        return
    for key, spec in (("model", model), ("data", data)):
        if spec is None:
            raise TaskOptionError(key, f"a user task needs both model and data ('package.module:factory' each); "
                                  f"{key} is missing")
        try:
            parse_spec(spec)
        except ValueError as exc:
            raise TaskOptionError(key, str(exc)) from None
    extra = ["name"] * (name is not None) + list(options)
    if extra:
        raise TaskOptionError(extra[0], f"a user task (model and data) takes no {', '.join(extra)}: those are for "
                              "the built-in tasks; drop them, or drop model and data")


def load_task(name: str | None = None, *, model: str | None = None, data: str | None = None,
              **options: Any) -> Task:
    """A built-in task by name, or the user's own from ``model`` and ``data`` factories.

    This is the one loader of ``mixprec train``, ``mixprec bench`` and ``mixprec doctor``.

    Args:
        name: A key of :data:`TASKS`, with its ``**options`` (``size``, ``arch``, ...).
        model: ``"package.module:factory"`` of a model whose forward returns a loss; with ``data``.
        data: ``"package.module:factory"`` returning :data:`~mixprec.tasks.user.DATA_CONTRACT`.

    Raises:
        TaskOptionError: for a task described wrongly (see :func:`check_task`).
        ImportError, AttributeError, TypeError: from :func:`load_factory`, naming the spec.

    Example:
        >>> load_task("digits", arch="cnn").name
        'digits/cnn'
    """
    check_task(name, model=model, data=data, **options)
    if model is not None:
        return user_task(model, data)
    return get_task(name, **options)

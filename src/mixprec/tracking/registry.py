"""From ``log_with`` to running trackers: what the Accelerator calls.

* :func:`resolve_log_with` at construction: checks every name (a wrong one is a ``ValueError`` listing
  the valid ones), that each tracker's package is installed, and that a tracker writing to a folder has one;
* :func:`start_trackers` in ``init_trackers``: builds, starts and configures them on the main process;
* :class:`Trackers` holds both steps and the running trackers: ``log``, ``get``, ``finish``.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from mixprec.tracking.base import GeneralTracker, LoggerType, missing_package
from mixprec.tracking.trackers import BUILTIN_TRACKERS

__all__ = ["TRACKER_CLASSES", "Trackers", "finish_trackers", "installed_tracker_names", "is_tracker", "register_tracker_class", "resolve_log_with",
           "start_trackers"]

#: name -> tracker class, for every name ``log_with`` takes besides ``"all"`` (built-in and registered).
TRACKER_CLASSES: dict[str, type[GeneralTracker]] = dict(BUILTIN_TRACKERS)

_DIR_FIX = ("pass project_dir=... to the Accelerator (or project_config=ProjectConfiguration(project_dir=..., "
            "logging_dir=...))")


def is_tracker(obj: Any) -> bool:
    """Whether ``obj`` is a tracker instance: a :class:`GeneralTracker`, or an object with a ``name`` and
    callable ``log``, ``store_init_configuration`` and ``finish`` (one written for Accelerate's class)."""
    if isinstance(obj, GeneralTracker):
        return True
    if isinstance(obj, (str, enum.Enum, type)):
        return False
    return hasattr(obj, "name") and all(callable(getattr(obj, m, None))
                                        for m in ("log", "store_init_configuration", "finish"))


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Make ``log_with`` take ``tracker_class.name``, as Accelerate's ``register_tracker_class`` does.

    ``init_trackers`` builds it as ``tracker_class(project_name, **init_kwargs.get(name, {}))``, with the
    logging directory as second argument where ``requires_logging_directory`` is true. Register it before
    building the Accelerator; registering a name again replaces the class, with a warning.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class() takes a subclass of mixprec.tracking.GeneralTracker, not "
                         f"{tracker_class!r}: derive your tracker class from it.")
    if not isinstance(getattr(tracker_class, "name", None), str) or not tracker_class.name:
        raise ValueError(f"{tracker_class.__name__} has no `name`: set `name = \"...\"` in its class body, the name "
                         f"log_with will take.")
    if not hasattr(tracker_class, "requires_logging_directory"):
        raise ValueError(f"{tracker_class.__name__} has no `requires_logging_directory`: set it to True in its class "
                         f"body if it writes to the Accelerator's logging directory, else to False.")
    if tracker_class.name == str(LoggerType.ALL):
        raise ValueError(f"{tracker_class.__name__}.name is 'all', which log_with reserves for every installed "
                         f"tracker: choose another name.")
    if tracker_class.name in TRACKER_CLASSES:
        warnings.warn(f"register_tracker_class(): {tracker_class.__name__} replaces "
                      f"{TRACKER_CLASSES[tracker_class.name].__name__} as log_with={tracker_class.name!r}.",
                      stacklevel=2)
    TRACKER_CLASSES[tracker_class.name] = tracker_class


def _valid_names() -> str:
    return ", ".join(repr(n) for n in [str(LoggerType.ALL), *TRACKER_CLASSES])


def _name(item: Any) -> str:
    if isinstance(item, str):
        return str(item) if isinstance(item, enum.Enum) else item
    if isinstance(item, enum.Enum):  # Accelerate's own LoggerType, whose str() is its value
        return str(item.value)
    raise ValueError(f"log_with takes tracker names, LoggerType members or GeneralTracker instances, not "
                     f"{type(item).__name__} {item!r}: use one of {_valid_names()}, or an instance of your "
                     f"GeneralTracker subclass.")


def _installed(cls: type[GeneralTracker]) -> bool:
    check = getattr(cls, "installed", None)
    return bool(check()) if callable(check) else True


def installed_tracker_names() -> list[str]:
    """The built-in trackers whose package is installed here (what ``"all"`` stands for)."""
    return [n for n in BUILTIN_TRACKERS if _installed(TRACKER_CLASSES[n])]


def _check_dir(name: str, logging_dir: Any, via_all: bool = False) -> None:
    if TRACKER_CLASSES[name].requires_logging_directory and logging_dir is None:
        where = f"log_with='all' includes {name!r} (installed here), which" if via_all else f"log_with={name!r}"
        raise ValueError(f"{where} writes its logs under the logging directory and none is set: {_DIR_FIX}"
                         + (", or list the trackers you want instead of 'all'." if via_all else "."))


def resolve_log_with(log_with: Any, logging_dir: str | os.PathLike[str] | None = None) -> list[str | GeneralTracker]:
    """``log_with`` checked and spelled out, what ``Accelerator.log_with`` holds (Accelerate's ``filter_trackers``).

    Args:
        log_with: ``None``, a name (``"tensorboard"``, ``"wandb"``, ``"mlflow"``, ``"comet_ml"``, ``"aim"``,
            ``"clearml"``, ``"dvclive"``, ``"swanlab"``, ``"trackio"``, a registered one, or ``"all"`` for every
            built-in tracker installed here), a :class:`LoggerType` (mixprec's or Accelerate's), a tracker instance,
            or a list or tuple of those.
        logging_dir: the Accelerator's logging directory (``project_dir`` unless set apart), ``None`` if unset.

    Returns:
        The tracker names (each once, in the order given, ``"all"`` expanded in Accelerate's order) and the
        tracker instances (used as they are).

    Raises:
        ValueError: a name that is no tracker (the message lists the valid ones), or a tracker writing to a
            folder (TensorBoard, Aim) without ``logging_dir``.
        ImportError: a tracker named explicitly whose package is not installed, naming the package (Accelerate
            leaves such a tracker out in silence).
    """
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    resolved: list[str | GeneralTracker] = []
    found_none_for_all = False
    for item in items:
        if is_tracker(item):
            resolved.append(item)
            continue
        name = _name(item)
        if name == str(LoggerType.ALL):
            installed = installed_tracker_names()
            found_none_for_all = not installed
            for n in installed:
                _check_dir(n, logging_dir, via_all=True)
            resolved += [n for n in installed if n not in resolved]
            continue
        if name not in TRACKER_CLASSES:
            raise ValueError(f"log_with={item!r} is not a tracker: use one of {_valid_names()}, or an instance of a "
                             f"GeneralTracker subclass (register_tracker_class() adds a name).")
        cls = TRACKER_CLASSES[name]
        if not _installed(cls):
            raise missing_package(name, getattr(cls, "pip_name", name))
        _check_dir(name, logging_dir)
        if name not in resolved:
            resolved.append(name)
    if found_none_for_all and not resolved:
        warnings.warn("log_with='all' found no tracker installed, so nothing is logged: install one, e.g. "
                      "`pip install tensorboard` (or wandb, mlflow, ...).", stacklevel=2)
    return resolved


def finish_trackers(trackers: Sequence[Any]) -> None:
    """``finish()`` every tracker, even after one fails; then raise the first failure."""
    first: BaseException | None = None
    for tracker in trackers:
        try:
            tracker.finish()
        except Exception as error:  # noqa: BLE001 - the others still need closing
            first = first or error
    if first is not None:
        raise first


def start_trackers(resolved: Sequence[str | GeneralTracker], project_name: str,
                   logging_dir: str | os.PathLike[str] | None, config: Mapping[str, Any] | None = None,
                   init_kwargs: Mapping[str, Mapping[str, Any]] | None = None, *,
                   is_main_process: bool) -> list[GeneralTracker]:
    """Build, start and configure the trackers of :func:`resolve_log_with`, as ``init_trackers`` does.

    Each name is built as ``cls(project_name, logging_dir, **init_kwargs[name])`` (``logging_dir`` only
    where ``requires_logging_directory``), a tracker instance is used as it is; then every tracker's
    ``start()``, then ``store_init_configuration(config)`` unless ``config`` is ``None``. If one fails,
    those already started are finished before the error propagates.

    On any other process than the main one this starts nothing and returns ``[]``: Accelerate's
    ``init_trackers`` and ``log`` run on the main process only, whatever a tracker's ``main_process_only``.

    Args:
        resolved: what :func:`resolve_log_with` returned.
        project_name: the project (run, experiment) name.
        logging_dir: the Accelerator's logging directory.
        config: the hyperparameters to record, or ``None``.
        init_kwargs: tracker name -> keyword arguments for its constructor, e.g. ``{"wandb": {"tags": ["a"]}}``.
        is_main_process: whether this is the main process (global rank 0).
    """
    if not is_main_process:
        return []
    init_kwargs = dict(init_kwargs or {})
    in_use = {e if isinstance(e, str) else getattr(e, "name", None) for e in resolved}
    for key, kwargs in init_kwargs.items():
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"init_kwargs[{key!r}] is a {type(kwargs).__name__}: it must be a dict of keyword "
                            f"arguments for that tracker, e.g. init_kwargs={{{key!r}: {{...}}}}.")
        if key not in in_use and key not in TRACKER_CLASSES:
            warnings.warn(f"init_kwargs[{key!r}] names no tracker, so it is not used: the keys are tracker names "
                          f"({', '.join(repr(n) for n in TRACKER_CLASSES)} or your trackers' `name`).", stacklevel=2)
    trackers: list[GeneralTracker] = []
    for entry in resolved:
        if not isinstance(entry, str):
            trackers.append(entry)
            continue
        cls, kwargs = TRACKER_CLASSES[entry], init_kwargs.get(entry, {})
        if cls.requires_logging_directory:
            if logging_dir is None:
                raise ValueError(f"log_with={entry!r} writes its logs under the logging directory and none is set: "
                                 f"{_DIR_FIX}.")
            trackers.append(cls(project_name, logging_dir, **kwargs))
        else:
            trackers.append(cls(project_name, **kwargs))
    started: list[GeneralTracker] = []
    try:
        for tracker in trackers:
            start = getattr(tracker, "start", None)
            if callable(start):
                start()
            started.append(tracker)
        if config is not None:
            for tracker in trackers:
                tracker.store_init_configuration(config)
    except BaseException:
        try:
            finish_trackers(started)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise
    return trackers


class Trackers:
    """The Accelerator's trackers: ``log_with`` resolved at construction, then the running trackers.

    The Accelerator holds one and forwards to it: ``init_trackers`` -> :meth:`init`, ``log`` -> :meth:`log`,
    ``get_tracker`` -> :meth:`get`, ``end_training`` -> :meth:`finish`; ``accelerator.log_with`` is
    :attr:`log_with` and ``accelerator.trackers`` is :attr:`trackers`.

    Args:
        log_with: as :func:`resolve_log_with` takes it.
        logging_dir: the Accelerator's logging directory (``project_dir`` unless set apart), ``None`` if unset.

    Example:
        >>> import tempfile
        >>> trackers = Trackers("tensorboard", logging_dir=tempfile.mkdtemp())
        >>> trackers.init("my_project", config={"lr": 1e-3}, is_main_process=True)
        >>> trackers.log({"loss": 0.5}, step=1)
        >>> trackers.get("tensorboard").name
        'tensorboard'
        >>> trackers.finish()
    """

    def __init__(self, log_with: Any = None, logging_dir: str | os.PathLike[str] | None = None):
        self.log_with = resolve_log_with(log_with, logging_dir)
        self.logging_dir = logging_dir
        self.trackers: list[GeneralTracker] = []

    def init(self, project_name: str, config: Mapping[str, Any] | None = None,
             init_kwargs: Mapping[str, Mapping[str, Any]] | None = None, *, is_main_process: bool) -> None:
        """Start the trackers of ``log_with`` (see :func:`start_trackers`) and add them to :attr:`trackers`."""
        self.trackers += start_trackers(self.log_with, project_name, self.logging_dir, config, init_kwargs,
                                        is_main_process=is_main_process)

    def log(self, values: Mapping[str, Any], step: int | None = None,
            log_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """``tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))`` for every tracker (none on
        the other processes, where this does nothing)."""
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    def get(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its library's object with ``unwrap``), as ``get_tracker`` returns it.

        Where no tracker runs (the other processes, or before ``init_trackers``) this is a placeholder
        :class:`GeneralTracker` whose methods do nothing, as in Accelerate.
        """
        if not self.trackers:
            return GeneralTracker(_blank=True)
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        running = ", ".join(repr(t.name) for t in self.trackers)
        raise ValueError(f"No tracker called {name!r} runs (those running: {running}): ask for one of them, or add "
                         f"{name!r} to the Accelerator's log_with.")

    def finish(self) -> None:
        """``finish()`` every tracker (each one even if another fails; the first failure is raised after)."""
        finish_trackers(self.trackers)

    def __iter__(self) -> Iterator[GeneralTracker]:
        """The running trackers."""
        return iter(self.trackers)

    def __len__(self) -> int:
        """How many trackers run."""
        return len(self.trackers)

"""The tracker interface (Accelerate's ``GeneralTracker`` and ``LoggerType``) and what every tracker shares.

A tracker is built in three steps, as in Accelerate: the constructor only records its arguments,
:meth:`GeneralTracker.start` opens the run (so nothing touches the process group or the disk before
the Accelerator is set up), then :meth:`GeneralTracker.store_init_configuration` records the config.
"""

from __future__ import annotations

import enum
import functools
import importlib.metadata
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec.nested import tree_map

__all__ = ["GeneralTracker", "LoggerType", "is_main_process", "on_main_process", "package_installed",
           "missing_package", "plain_values", "warn_dropped"]


class _ContainsValues(enum.EnumMeta):
    """Lets ``"wandb" in LoggerType`` test the values, as Accelerate's enum does (Python 3.10 and 3.11 raise)."""

    def __contains__(cls, item: object) -> bool:
        try:
            cls(item)
        except ValueError:
            return False
        return True


class LoggerType(str, enum.Enum, metaclass=_ContainsValues):
    """The trackers ``log_with`` names, with Accelerate's member names and values.

    A member is its value as a string (``LoggerType.WANDB == "wandb"``), ``str()`` gives the value,
    and ``LoggerType.list()`` every value. ``ALL`` stands for every tracker installed here.
    """

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"

    def __str__(self) -> str:
        """The value, e.g. ``"comet_ml"``."""
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        """Every member's value, in the order they are declared."""
        return [str(member) for member in cls]


def is_main_process() -> bool:
    """Whether this is the process of global rank 0 (Accelerate's main process).

    The process group's rank once one is set up, else ``RANK`` as torchrun sets it, else ``True``.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0") or 0) == 0


def on_main_process(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a tracker's ``method`` only on the main process when the tracker's ``main_process_only`` is set
    (elsewhere the call does nothing and returns ``None``), as Accelerate's trackers do."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not is_main_process():
            return None
        return method(self, *args, **kwargs)

    return run


def package_installed(module: str, distributions: Iterable[str] = ()) -> bool:
    """Whether ``module`` can be imported and, when ``distributions`` are named, one of them is installed.

    The second check is Accelerate's: a folder called ``wandb`` or ``mlruns`` in the working directory
    (which those libraries create) is importable as a namespace package without being the library.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):  # a parent package missing, or a module whose __spec__ is None
        return False
    names = list(distributions)
    for name in names:
        try:
            importlib.metadata.distribution(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return not names


def missing_package(tracker: str, pip_name: str) -> ImportError:
    """The ``ImportError`` for a tracker whose package is not installed, naming the package and the fix."""
    spec = f"'{pip_name}'" if any(c in pip_name for c in "<>=!~ ") else pip_name
    return ImportError(f"log_with={tracker!r} needs the `{pip_name}` package, which is not installed in this "
                       f"environment: `pip install {spec}`, or leave {tracker!r} out of log_with.")


def _plain(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        leaf = leaf.detach().cpu()
        return (leaf.float() if leaf.dtype == torch.bfloat16 else leaf).tolist()
    if type(leaf).__module__ == "numpy" and getattr(leaf, "shape", None) == ():  # a numpy scalar
        return leaf.item()
    return leaf


def plain_values(values: Any) -> Any:
    """``values`` with every tensor (and numpy scalar) as plain Python numbers: a 0-d tensor becomes a number,
    any other a (nested) list. Accelerate does the same (``listify``) before logging to TensorBoard."""
    return tree_map(_plain, values)


def warn_dropped(tracker: str, key: str, value: Any, accepts: str) -> None:
    """Warn that ``values[key]`` was not logged to ``tracker`` because of its type."""
    warnings.warn(f"{tracker} did not log {key!r}: its value is a {type(value).__name__} and {tracker} takes "
                  f"{accepts}; log a number (e.g. `tensor.item()`) instead.", stacklevel=3)


class GeneralTracker:
    """The base of every tracker, with Accelerate's interface; subclass it for your own tracker.

    A subclass defines:

    * ``name`` (``str``): how ``log_with``, ``init_kwargs``, ``log_kwargs`` and ``get_tracker`` refer to it;
    * ``requires_logging_directory`` (``bool``): whether it is built as ``cls(project_name, logging_dir,
      **init_kwargs)`` (else ``cls(project_name, **init_kwargs)``);
    * ``tracker``: a property returning the library's own object (the run, the writer), what
      ``get_tracker(name, unwrap=True)`` returns;

    and may override :meth:`start`, :meth:`store_init_configuration`, :meth:`log` and :meth:`finish`.
    ``main_process_only`` (default ``True``) says whether the built-in trackers' methods do anything on
    other processes; through the Accelerator, as in Accelerate, only the main process has trackers at all.

    Args:
        _blank: build the placeholder ``get_tracker`` returns on the other processes, whose methods do
            nothing, without checking the attributes above.

    Example:
        >>> class Recorder(GeneralTracker):
        ...     name, requires_logging_directory = "recorder", False
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.rows = []
        ...     @property
        ...     def tracker(self):
        ...         return self.rows
        ...     def log(self, values, step=None, **kwargs):
        ...         self.rows.append((step, dict(values)))
        >>> r = Recorder(); r.log({"loss": 0.5}, step=1); r.rows
        [(1, {'loss': 0.5})]
    """

    main_process_only = True

    def __init__(self, _blank: bool = False):
        if _blank:
            return
        missing = [f"`{attr}`" for attr in ("name", "requires_logging_directory") if not hasattr(self, attr)]
        if "tracker" not in dir(self):  # a property of the subclass: look it up without calling it
            missing.append("`tracker`")
        if missing:
            raise NotImplementedError(f"{type(self).__name__} lacks {', '.join(missing)}: define them in the class "
                                      f"body (see GeneralTracker's docstring) before building it.")

    def start(self) -> None:
        """Open the run; called once by ``init_trackers`` before :meth:`store_init_configuration`."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` (name -> ``bool``, ``str``, ``float``, ``int`` or ``None``) as the run's hyperparameters."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` (name -> number, string, ...) at ``step``; ``kwargs`` are ``log_kwargs[self.name]``."""

    def finish(self) -> None:
        """Close the run (flush and release what :meth:`start` opened)."""

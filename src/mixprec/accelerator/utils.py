"""Accelerate's utilities a training script imports beside the Accelerator (``accelerate.utils``,
``accelerate.logging``), for scripts that run without Accelerate installed: the same names and
behaviour, on mixprec's process group.

Example:
    >>> from mixprec import gather_object, set_seed
    >>> set_seed(0)
    >>> gather_object(["only this process"])
    ['only this process']
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mixprec.distributed import groups as D

__all__ = ["broadcast_object_list", "find_executable_batch_size", "gather_object", "get_logger", "set_seed"]


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and torch's RNGs (every device's), as Accelerate's ``set_seed`` does.

    Args:
        seed: the seed.
        device_specific: add this process's rank, so processes draw differently.
        deterministic: also ``torch.use_deterministic_algorithms(True)``.
    """
    if device_specific:
        seed += _rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator too
    if deterministic:
        torch.use_deterministic_algorithms(True)


def gather_object(object: list[Any] | Any) -> list[Any]:  # noqa: A002 - Accelerate's name for it
    """Every process's ``object`` (picklable), concatenated in rank order when they are lists, as
    Accelerate's ``gather_object``; ``object`` itself in one process."""
    parts = D.all_gather_object(object)
    if len(parts) == 1:
        return parts[0]
    return [x for part in parts for x in part] if all(isinstance(p, (list, tuple)) for p in parts) else parts


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Process ``from_process``'s ``object_list``, written in place on every process, and returned."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def _is_out_of_memory(error: BaseException) -> bool:
    messages = ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                "DefaultCPUAllocator: can't allocate memory", "out of memory")
    return isinstance(error, (torch.OutOfMemoryError, RuntimeError)) and any(m in str(error) for m in messages)


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[], int] | None = None) -> Any:
    """Decorate ``function(batch_size, ...)`` to be called with ``starting_batch_size``, then with a
    smaller one (x0.9, or ``reduce_batch_size_fn()``) after each out-of-memory error, as
    Accelerate's does; call the decorated function without the batch size.

    Raises:
        RuntimeError: the batch size reached zero.
        TypeError: the batch size was passed to the decorated function (the decorator passes it).
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    batch_size = starting_batch_size

    def reduce() -> int:
        return reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch_size * 0.9)

    @functools.wraps(function)
    def decorated(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v}" for p, v in zip(params[1:], args[1:]))
            raise TypeError(f"Batch size was passed into `{function.__name__}` as the first argument when called. "
                            f"Remove this as the decorator already does so: `{function.__name__}({given})`")
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as e:
                if not _is_out_of_memory(e):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = reduce()
    return decorated


class MultiProcessAdapter(logging.LoggerAdapter):
    """A logger that logs on the main process only (``main_process_only=False``: on every process;
    ``in_order=True``: every process, one after the other), as Accelerate's ``get_logger`` gives."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        if main_only and not in_order:
            if _rank() == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        for turn in range(world if in_order else 1):
            if not in_order or turn == _rank():
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            if in_order:
                D.barrier()


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """``logging.getLogger(name)`` wrapped to log on the main process only (see
    :class:`MultiProcessAdapter`); ``log_level`` (or ``$ACCELERATE_LOG_LEVEL``) sets its level."""
    level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if level is not None:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})

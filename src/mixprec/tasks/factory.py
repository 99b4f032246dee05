"""``load_factory("package.module:factory")``: import the callable a spec names, or say what is wrong."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["load_factory", "parse_spec"]


def parse_spec(spec: str) -> tuple[str, str]:
    """``"package.module:factory"`` as ``("package.module", "factory")``, checked without importing.

    Raises:
        ValueError: for anything but one colon between a module path and a (dotted) name.

    Example:
        >>> parse_spec("user_task:model")
        ('user_task', 'model')
    """
    module_name, sep, attr_path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"factory spec {spec!r} must look like 'package.module:factory' (one colon between "
                         "the module path and the name of the factory in it)")
    return module_name, attr_path


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``"package.module:factory"`` and return the object it names.

    The attribute may be dotted (``"pkg.mod:Builder.create"``). The module is imported from
    ``sys.path``: for a file in the working directory, run with ``PYTHONPATH=.``.

    Args:
        spec: ``"module:attribute"``.

    Raises:
        ValueError: for a spec without exactly one colon between a module and a name.
        ImportError: naming the module that was not found, or the package its import needs.
        AttributeError: naming the attribute that is not there.
        TypeError: when the object is not callable.

    Example:
        >>> load_factory("mixprec.tasks:get_task") is get_task
        True
    """
    module_name, attr_path = parse_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ImportError(f"module {module_name!r} (from factory spec {spec!r}) was not found; check the "
                              "spelling and that it is installed or on PYTHONPATH") from exc
        raise ImportError(f"module {module_name!r} (from factory spec {spec!r}) was found but importing it "
                          f"failed: it needs {exc.name!r}, which is not installed") from exc
    target: Any = module
    for depth, part in enumerate(attr_path.split(".")):
        if not hasattr(target, part):
            owner = ".".join([module_name] + attr_path.split(".")[:depth]) if depth else f"module {module_name!r}"
            raise AttributeError(f"{owner} has no attribute {part!r} (from factory spec {spec!r}); check the name "
                                 "after the colon")
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec!r} names a {type(target).__name__}, not a callable factory")
    return target

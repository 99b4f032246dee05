"""Started in the Python processes ``mixprec run`` starts (its folder is put first on their
``PYTHONPATH``): the switch under transformers' Trainer, :func:`mixprec.patch_transformers`, is
turned on in them too, as it is in ``mixprec run``'s own process. trl's command line, ``torchrun``
and ``accelerate launch`` start the training in new processes; this is how the switch reaches them.

``MIXPREC_PATCH_TRANSFORMERS`` (set by ``mixprec run``, JSON: the precision and mixprec's own
Accelerator options) says what to turn on. Nothing is imported at start-up: the switch is turned
on when ``transformers.trainer`` is first imported, so a process that never trains pays nothing.
A ``sitecustomize`` the environment had already is run after this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys

ENV = "MIXPREC_PATCH_TRANSFORMERS"
_TARGET = "transformers.trainer"


class _SwitchOnImport(importlib.abc.MetaPathFinder):
    """Turns the switch on right after ``transformers.trainer`` is imported."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)  # find it the usual way, once
        found = importlib.util.find_spec(name)
        if found is None or found.loader is None:
            return found
        loader, spec = found.loader, self.spec

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                _switch(spec)

            def __getattr__(self, attr):  # get_source, get_filename...: the file's own loader's
                return getattr(loader, attr)

        found.loader = _Loader()
        return found


def _switch(spec: dict) -> None:
    from mixprec.integrations.transformers_engine import patch_transformers

    patch_transformers(spec.get("precision"), **spec.get("options", {}))


def install(spec: dict) -> None:
    """Turn the switch on now if transformers' Trainer is imported already, else when it is."""
    if _TARGET in sys.modules:
        _switch(spec)
    elif not any(isinstance(f, _SwitchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _SwitchOnImport(spec))


def _run_next_sitecustomize() -> None:
    """The ``sitecustomize`` further down ``sys.path``, which this one's place first hid."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":  # started by Python itself, not imported as mixprec.cli.engine_boot...
    if os.environ.get(ENV):
        install(json.loads(os.environ[ENV]))
    _run_next_sitecustomize()

"""A griffe extension for the API reference: the docstrings' ``Example:`` sections are read as
Google style's ``Examples:``, so their ``>>>`` lines render as code (griffe takes the singular as
an admonition of plain text, where ``x["key"]`` reads as a Markdown link)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\g<indent>Examples:", obj.docstring.value)

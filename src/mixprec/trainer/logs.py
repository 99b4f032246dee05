"""Where the Trainer's info lines go: transformers' own logger where transformers is installed.

Code and tests written for the Hugging Face Trainer read its lines ("***** Running training *****",
"Saving model checkpoint to ...", "Loading best model from ...") from the ``transformers`` logger
tree, at the verbosity ``TrainingArguments.log_level`` sets there. mixprec's Trainer writes the
same lines to ``transformers.trainer`` (through transformers' logging module, so its handler and
verbosity apply) and sets that verbosity as transformers' Trainer does. Without transformers they
go to ``mixprec.trainer``. mixprec's own warnings (skipped steps, checkpoints skipped on resume)
stay on ``mixprec.trainer`` either way.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["get_verbosity", "set_verbosity", "trainer_logger"]


def _transformers_logging() -> Any:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    return hf_logging


def trainer_logger(module: str = "trainer") -> logging.Logger:
    """The logger of the lines transformers' ``module`` writes (``"trainer"``; ``"trainer_callback"``
    for the callback handler's): ``transformers.<module>``, set up by transformers' logging module,
    where transformers is installed, else ``mixprec.trainer``."""
    hf_logging = _transformers_logging()
    return hf_logging.get_logger(f"transformers.{module}") if hf_logging else logging.getLogger("mixprec.trainer")


def get_verbosity() -> int:
    """The level the Trainer's info lines are filtered at now (transformers' verbosity, or the
    ``mixprec`` logger's): what ``log_level="passive"`` keeps."""
    hf_logging = _transformers_logging()
    return hf_logging.get_verbosity() if hf_logging else logging.getLogger("mixprec").getEffectiveLevel()


def set_verbosity(level: int) -> None:
    """Set the level of the ``mixprec`` logger and, where installed, transformers' verbosity, as
    transformers' Trainer does with ``args.get_process_log_level()``."""
    logging.getLogger("mixprec").setLevel(level)
    hf_logging = _transformers_logging()
    if hf_logging:
        hf_logging.set_verbosity(level)

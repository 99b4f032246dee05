"""The random state in the format transformers' Trainer writes it: ``rng_state.pth`` (one process)
or ``rng_state_<rank>.pth`` (one per process), read without running code.

The file holds ``{"python": random.getstate(), "numpy": np.random.get_state(), "cpu":
torch.get_rng_state()}`` and, where CUDA is available, ``"cuda"`` (one device's state; every
device's under a process group). mixprec's own checkpoints keep the same states in
``random_states_<rank>.bin``; this file is written beside them so that transformers' Trainer
resumes a mixprec checkpoint with the random state it would have had.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch

from mixprec.checkpoint.folder import load_tensor_file

__all__ = ["read_transformers_rng", "set_transformers_rng_state", "transformers_rng_name", "transformers_rng_state"]

log = logging.getLogger("mixprec")


def transformers_rng_name(rank: int, world_size: int) -> str:
    """The file transformers reads for process ``rank`` of ``world_size``."""
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def transformers_rng_state(distributed: bool) -> dict[str, Any]:
    """This process's random state as transformers' ``_save_rng_state`` records it (CUDA: the
    current device's state, every device's when ``distributed``)."""
    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


def read_transformers_rng(path: Path) -> dict[str, Any]:
    """``rng_state.pth`` read with ``torch.load(weights_only=True)``, NumPy arrays admitted (as
    transformers reads it); a file holding anything else is refused (``CheckpointError``)."""
    return load_tensor_file(path, numpy_arrays=True)


def set_transformers_rng_state(state: dict[str, Any], distributed: bool) -> None:
    """Restore the Python, NumPy, torch and CUDA random states of a transformers RNG file, as
    transformers' ``_load_rng_state`` does (a CUDA state that does not fit this machine is
    reported, not raised: the run continues, without the same random numbers)."""
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        try:
            if distributed:
                torch.cuda.random.set_rng_state_all(state["cuda"])
            else:
                torch.cuda.random.set_rng_state(state["cuda"])
        except (RuntimeError, TypeError, ValueError) as e:
            log.error("mixprec: the CUDA random state of the checkpoint was not restored (%s); the run continues "
                      "without the random numbers an uninterrupted one would draw", e)

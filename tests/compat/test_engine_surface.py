"""Every name transformers' Trainer and trl's trainers read on their Accelerator, read from their
installed source: each exists on mixprec's Accelerator, its ``state`` and its ``gradient_state``
(private ones included: ``_set_sync_gradients``, ``_models``, ...), so a library built on
transformers' Trainer finds what it reads when ``mixprec.patch_transformers()`` is on."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import mixprec

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

#: Names read only in branches for what mixprec does not run, and why each is absent.
NOT_RUN: dict[str, str] = {}


def _sources() -> list[Path]:
    hf = Path(transformers.__file__).parent
    return [hf / "trainer.py", hf / "trainer_seq2seq.py", hf / "trainer_pt_utils.py", hf / "trainer_callback.py",
            hf / "integrations" / "integration_utils.py", *sorted((Path(trl.__file__).parent / "trainer").glob("*.py"))]


def _chain(node: ast.AST) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def names_read() -> dict[str, set[str]]:
    """``{"accelerator": {...}, "state": {...}, "gradient_state": {...}}``: every attribute read on
    ``self.accelerator`` / ``trainer.accelerator`` / ``accelerator`` (and on its state and gradient state)."""
    found: dict[str, set[str]] = {"accelerator": set(), "state": set(), "gradient_state": set()}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            chain = _chain(node) if isinstance(node, ast.Attribute) else []
            for i, part in enumerate(chain[:-1]):
                if part == "accelerator" and (i == 0 or chain[i - 1] in ("self", "trainer")):
                    nxt = chain[i + 1]
                    if nxt in ("state", "gradient_state") and len(chain) > i + 2:
                        found[nxt].add(chain[i + 2])
                    else:
                        found["accelerator"].add(nxt)
                    break
    return found


def test_the_scan_finds_what_the_trainers_are_known_to_read():
    found = names_read()
    assert {"prepare", "backward", "gather_for_metrics", "unwrap_model", "_models"} <= found["accelerator"]
    assert "_set_sync_gradients" in found["gradient_state"] and "fsdp_plugin" in found["state"]


def test_every_name_the_trainers_read_on_their_accelerator_exists_on_mixprecs():
    acc = mixprec.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    objects = {"accelerator": acc, "state": acc.state, "gradient_state": acc.gradient_state}
    missing = sorted(f"{where}.{name}" for where, names in names_read().items() for name in names
                     if name not in NOT_RUN and not hasattr(objects[where], name))
    assert not missing, f"transformers' or trl's trainers read these, which mixprec's Accelerator lacks: {missing}"

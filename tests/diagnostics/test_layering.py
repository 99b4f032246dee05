"""``mixprec.diagnostics`` observes only: it sits below the Accelerator and the Trainer and imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

import mixprec.diagnostics

# The layers above diagnostics (DESIGN.md): what diagnostics may be used by, never use.
ABOVE = ("accelerator", "wrappers", "distributed", "checkpoint", "trainer", "tasks", "doctor", "bench", "cli")


def _mixprec_imports(path: Path) -> set[str]:
    """The mixprec modules a file imports, anywhere in it (function-local imports included)."""
    package = "mixprec.diagnostics"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("mixprec.")}


def test_no_diagnostics_module_imports_the_accelerator_the_trainer_or_the_doctor():
    folder = Path(mixprec.diagnostics.__file__).parent
    offending = {f"{path.name}: {module}" for path in sorted(folder.glob("*.py"))
                 for module in _mixprec_imports(path) if module.split(".")[1] in ABOVE}
    assert not offending, f"diagnostics imports a layer above it: {sorted(offending)}"


def test_the_layering_check_sees_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..accelerator import Accelerator\ndef f():\n    from ..trainer.outputs import call_model\n")
    assert {"mixprec.accelerator.accelerator", "mixprec.trainer.outputs"} <= _mixprec_imports(probe)

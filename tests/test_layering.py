"""The house's layers (DESIGN.md): every module imports only the layers below it, no import circle
(function-local imports count), no module imports another's private name, few modules loose at the root."""

from __future__ import annotations

import ast
from pathlib import Path

import mixprec

SRC = Path(mixprec.__file__).parent
# Top to bottom; each layer may import its own folder and the layers below it (a tuple is one level).
LAYERS = ["cli", "apps", "trainer", "accelerator", "tracking",
          ("precision", "checkpoint", "distributed", "diagnostics"), "tasks", "leaves"]
LEAVES = {"models", "data", "nested", "hardware"}
# Siblings of one level that may use each other (none, today).
SIBLINGS: set[tuple[str, str]] = set()


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The mixprec modules ``path`` imports, anywhere in it (relative and function-local included)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join([*base, node.module] if node.module else base)
            found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names}
    return {m for m in found if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    files = {_name(p): p for p in SRC.rglob("*.py")}
    return {m: _imports(p, m, set(files)) for m, p in files.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "root" if len(parts) == 1 else "leaves" if parts[1] in LEAVES else parts[1]


def _level(layer: str) -> int:
    return next(i for i, entry in enumerate(LAYERS) if layer == entry or layer in entry)


def test_every_module_imports_only_its_own_folder_and_the_layers_below():
    bad = []
    for module, imported in sorted(_graph().items()):
        mine = _layer(module)
        if mine == "root":  # mixprec/__init__.py: the public face
            continue
        for other in sorted(imported):
            theirs = _layer(other)
            if theirs == "root" or (theirs != mine and _level(theirs) <= _level(mine)
                                    and (mine, theirs) not in SIBLINGS):
                bad.append(f"{module} -> {other}")
    assert not bad, f"imports against the layers: {bad}"


def test_there_is_no_import_circle():
    graph, index, low, stack, cycles = _graph(), {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import circles: {cycles}"


def test_no_module_imports_another_modules_private_name():
    bad = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                bad += [f"{_name(path)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and (node.level or (node.module or "").startswith("mixprec"))]
            elif isinstance(node, ast.Import):
                bad += [f"{_name(path)}: {a.name}" for a in node.names
                        if a.name.startswith("mixprec") and any(p.startswith("_") for p in a.name.split("."))]
    assert not bad, f"private names imported from another module: {bad}"


def test_at_most_eight_modules_lie_loose_at_the_package_root():
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert len(loose) <= 8, loose


def test_the_check_sees_relative_and_function_local_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "mixprec" / "diagnostics"
    pkg.mkdir(parents=True)
    probe = pkg / "probe.py"
    probe.write_text("from ..accelerator import Accelerator\ndef f():\n    from ..trainer.trainer import Trainer\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path / "mixprec")
    known = {"mixprec.accelerator", "mixprec.trainer.trainer", "mixprec.diagnostics.probe"}
    assert _imports(probe, "mixprec.diagnostics.probe", known) == {"mixprec.accelerator", "mixprec.trainer.trainer"}

"""The package's layers, read statically with ``ast``: every import counts (relative and function-local too)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"
# Top to bottom: each layer may import its own folder and the layers strictly below (a tuple is one level).
# DESIGN.md puts ``mixprec.lightning`` (the name Lightning users import) in the integrations layer.
LAYERS = ["cli", "apps", ("integrations", "lightning"), "trainer", "accelerator", "tracking",
          ("precision", "checkpoint", "distributed", "diagnostics"), "tasks", "leaves"]
LEAVES = {"models", "data", "nested", "hardware"}
# Within one level, which sibling each may import: mixprec.lightning is a name for its integration's classes.
SIBLINGS = {"precision": set(), "checkpoint": set(), "distributed": set(), "diagnostics": set(),
            "lightning": {"integrations"}, "integrations": set()}


def _modules(root: Path) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _resolve(name: str, known: set[str], top: str) -> str | None:
    """The longest known module ``name`` starts with; ``name`` itself if under ``top`` but unknown."""
    parts = name.split(".")
    if parts[0] != top:
        return None
    return next((".".join(parts[:i]) for i in range(len(parts), 1, -1) if ".".join(parts[:i]) in known), name)


def _imports(path: Path, module: str, known: set[str], top: str) -> list[tuple[str, str | None]]:
    """(module, name or None) for each package import anywhere in ``path``, relative ones resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(m, None) for a in node.names if (m := _resolve(a.name, known, top))]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = _resolve(".".join([*base, node.module] if node.module else base), known, top)
            for a in node.names if mod else ():
                found.append((f"{mod}.{a.name}", None) if f"{mod}.{a.name}" in known else (mod, a.name))
    return found


def _graph(root: Path) -> dict[str, set[str]]:
    files = _modules(root)
    return {m: {t for t, _ in _imports(p, m, set(files), root.name)} - {m} for m, p in files.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "root" if len(parts) == 1 else "leaves" if parts[1] in LEAVES else parts[1]


def _level(layer: str) -> int | None:
    return next((i for i, entry in enumerate(LAYERS) if layer == entry or layer in entry), None)


def _layering_violations(root: Path) -> list[str]:
    files, bad = _modules(root), []
    for module, imported in sorted(_graph(root).items()):
        mine, where = _layer(module), files[module].relative_to(root.parent).as_posix()
        if mine == "root":  # the package's __init__: the public face
            continue
        if _level(mine) is None:
            bad.append(f"{where}: (its folder is in no layer)")
        for other in sorted(imported):
            theirs = _layer(other)
            if theirs == mine or theirs in SIBLINGS.get(mine, ()):
                continue
            if theirs == "root" or _level(theirs) is None or _level(mine) is None or _level(theirs) <= _level(mine):
                bad.append(f"{where}: {other}")
    return bad


def _private(part: str) -> bool:
    return part.startswith("_") and not part.endswith("__")


def test_every_module_imports_only_its_own_folder_and_the_layers_below():
    bad = _layering_violations(SRC)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_there_is_no_import_circle_among_the_packages_modules():
    graph, index, low, stack, cycles = _graph(SRC), {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                cycles.append(" <-> ".join(sorted(part)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_no_module_imports_another_modules_private_name():
    files, bad = _modules(SRC), []
    for module, path in files.items():
        where = path.relative_to(SRC.parent).as_posix()
        for target, name in _imports(path, module, set(files), SRC.name):
            parts = target.split(".")
            # A private module may be used only inside the package that holds it.
            bad += [f"{where}: {target}" for i, part in enumerate(parts)
                    if _private(part) and not f"{module}.".startswith(".".join(parts[:i]) + ".")]
            if name and _private(name) and target != module:
                bad.append(f"{where}: {target}.{name}")
    assert not bad, "private names imported from another module:\n" + "\n".join(sorted(set(bad)))


def test_at_most_eight_modules_lie_loose_at_the_package_root():
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert len(loose) <= 8, loose


def test_the_analyser_sees_relative_and_function_local_imports(tmp_path):
    root = tmp_path / "mixprec"
    for folder in ("diagnostics", "accelerator", "trainer"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "trainer" / "trainer.py").write_text("")
    (root / "diagnostics" / "probe.py").write_text(
        "from ..accelerator import Accelerator\ndef f():\n    from ..trainer import trainer\n")
    assert _graph(root)["mixprec.diagnostics.probe"] == {"mixprec.accelerator", "mixprec.trainer.trainer"}
    assert _layering_violations(root) == ["mixprec/diagnostics/probe.py: mixprec.accelerator",
                                          "mixprec/diagnostics/probe.py: mixprec.trainer.trainer"]

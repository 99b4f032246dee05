"""Mutation testing of the modules where a silent bug loses data or gives a wrong number (issue 41).

    nice -n 10 .venv/bin/python tests/mutation/run.py scaler             # one target: its score, its survivors
    nice -n 10 .venv/bin/python tests/mutation/run.py --all              # every target (1.5 to 2 hours on 2 cores)
    .venv/bin/python tests/mutation/run.py --list fp8_search             # the mutants, none run
    .venv/bin/python tests/mutation/run.py --show scaler:215.2           # one mutant: the line, before and after
    nice -n 10 .venv/bin/python tests/mutation/run.py scaler --only scaler:215.2 scaler:230.1   # rerun a few

Each mutant is one small change of the source (an operator, a comparison, ``and``/``or``, a
constant, ``min``/``max``, ``break``/``continue``, a removed ``not``, a negated condition, a call
statement removed: the operator list is :func:`_mutations`), made to the module's syntax tree
(``ast``) and compiled in memory: the file on disk is never changed, so the tree may be the one
others work in, though a copy (``git worktree add /tmp/mut HEAD``) keeps the sources still for the
run. Strings are mutated only where they are names (keys, file names, modes: no whitespace), not
messages; docstrings, f-strings and annotations are left alone.

Each target (:data:`TARGETS`) names its files (a whole module, or a list of functions), and the
fast, in-process tests that exercise them. First a baseline: those tests run once, unmutated,
each traced to the lines of the target it executes (they must all pass). Then each mutant runs in
a forked child (torch and pytest imported once, before any fork) that imports the mutated module
from memory and runs only the tests that execute the mutated lines (every test of the target for
a change that runs at import: a constant at module level, a default argument), fastest first,
stopping at the first failure, under a per-mutant timeout (``--timeout``; default three times the
baseline's time of those tests plus 20 s). A test failing, an import failing or the timeout kills
the mutant; the tests passing is a survivor, and so is a mutant no test executes ("not run by
any test"). Tests that run the code in another process (torchrun, a script in a subprocess) see the
file on disk, not the mutant: the targets leave them out.

The output: per target, ``killed/total`` (the mutation score), the timeouts among the killed, and
each survivor by id (``<file stem>:<line>.<n>``, the n-th mutant of that line), with its line and
change. ``tests/README.md`` records the scores and explains each survivor.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# Tests that run the code in another process (they would see the file on disk, not the mutant),
# or that are slow and test something else; left out of every target.
_OUT_OF_PROCESS = (
    "test_save_kill_load_continue_equals_an_uninterrupted_run_bit_for_bit",
    "test_a_checkpoint_write_that_fails_for_real_leaves_the_previous_one_and_says_what_it_needs",
    "test_a_checkpoints_folder_locked_by_another_live_run_is_refused_and_its_saves_kept",
    "test_a_damaged_file_of_rank_1_fails_the_load_alike_on_both_ranks_under_torchrun",
    "test_a_damaged_shard_of_rank_1_fails_the_load_alike_under_plain_multiprocessing",
    "test_train_killed_mid_epoch_and_resumed_equals_uninterrupted_bit_for_bit",
    "test_tensorboard_and_log_history_hold_each_step_once_after_sigkill_and_sigterm_resumes",
    "test_with_torch_held_to_avx2_kernels_auto_finds_no_native_16_bit_format",
)
_SLOW = (
    "test_mid_epoch_resume_with_two_persistent_workers_is_bit_for_bit",  # 27 s: loader workers, not the resume
    "test_real_hugging_face_bert_with_a_datasets_dataset",
)


@dataclass(frozen=True)
class Target:
    """What one target mutates and which tests judge it.

    ``files``: path (from the repository root) -> ``None`` (the whole module) or the functions to
    mutate, as ``"Class.method"``/``"function"``, or ``("Class.method", first, last)``: that
    function's statements from the first whose source starts with ``first`` through the one that
    starts with ``last``.
    """

    files: dict[str, list[str | tuple[str, str, str]] | None]
    tests: tuple[str, ...]
    exclude: tuple[str, ...] = _OUT_OF_PROCESS + _SLOW


_PRECISION_TESTS = ("tests/test_scaler.py", "tests/precision/test_multi_optimizer.py",
                    "tests/precision/test_nonfinite_guard.py", "tests/precision/test_precision.py",
                    "tests/test_accelerator.py", "tests/test_accelerate_compat.py", "tests/diagnostics/test_syncs.py",
                    "tests/diagnostics/test_in_every_tier.py", "tests/diagnostics/test_gradient_stats.py")
_CHECKPOINT_TESTS = ("tests/test_checkpoint.py", "tests/test_checkpoint_scale.py", "tests/compat/test_rotation.py",
                     "tests/test_house.py", "tests/test_full_disk.py", "tests/trainer/test_checkpoints_both_ways.py",
                     "tests/trainer/test_resume_resaved_weights.py")

TARGETS: dict[str, Target] = {
    "scaler": Target({"src/mixprec/precision/scaler.py": None}, _PRECISION_TESTS),
    "scaled_steps": Target({"src/mixprec/precision/scaled_steps.py": None}, _PRECISION_TESTS),
    "folder": Target({"src/mixprec/checkpoint/folder.py": [
        "_fsync_dir", "staging_dir", "commit_checkpoint", "write_checkpoint", "read_manifest", "is_complete_checkpoint",
        "checkpoint_problem", "_check_size", "numbered_checkpoints", "rotate_checkpoints", "retire_checkpoint",
        "remove_stale", "verify_checkpoint",
        "raise_first_problem", "CheckpointReader.__init__", "CheckpointReader.check", "CheckpointReader.read_bytes",
        "CheckpointReader.verify"]}, _CHECKPOINT_TESTS),
    "integrity": Target({"src/mixprec/checkpoint/integrity.py": None}, _CHECKPOINT_TESTS),
    "trainer_resume": Target({
        "src/mixprec/trainer/checkpoints.py": None,
        "src/mixprec/trainer/trainer.py": [
            "Trainer._load_checkpoint", ("Trainer._train", "resume = ", "if restarted > 0 and resume"),
            ("Trainer._train", "self._transformers_resume = None", "if resume_path is not None"),
            "Trainer._resumed_loader", "Trainer._continue_transformers_run", "Trainer._load_callback_state",
            "Trainer._save_checkpoint"],
    }, ("tests/trainer/test_resume_continues_the_run.py", "tests/trainer/test_checkpoints_both_ways.py",
        "tests/trainer/test_resume_resaved_weights.py", "tests/trainer/test_peft.py", "tests/trainer/test_trainer.py",
        "tests/trainer/test_trainer_hf_compat.py", "tests/test_checkpoint_scale.py", "tests/compat/test_rotation.py",
        "tests/precision/test_nonfinite_guard.py", "tests/diagnostics/test_in_every_tier.py", "tests/test_house.py")),
    "fp8_search": Target({"src/mixprec/apps/fp8_search.py": None},
                         ("tests/apps/test_fp8_search.py", "tests/diagnostics/test_fp8_doctor.py")),
}


# -- the mutants -------------------------------------------------------------------------------

_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
          ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
          ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitAnd}
_CMPOP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
          ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
           ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.Lt: "<",
           ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not",
           ast.In: "in", ast.NotIn: "not in", ast.And: "and", ast.Or: "or"}
_SWAP_NAMES = {"min": "max", "max": "min", "any": "all", "all": "any"}
# Calls whose arguments are messages: their strings are not mutated.
_MESSAGE_CALLS = {"warning", "warn", "info", "debug", "error", "exception", "print"}


@dataclass
class Mutant:
    id: str
    path: str  # from the repository root
    module: str
    line: int
    lines: tuple[int, int]  # the lines whose execution runs the change
    at_import: bool  # runs when the module is imported (module or class level, a decorator)
    default_of: int | None  # a default argument: the first line of the function it is a default of
    description: str
    index: int  # its place among the file's mutants


@dataclass
class _Site:
    node: ast.AST
    stmt: ast.stmt | None
    at_import: bool
    default_of: int | None
    description: str
    apply: Callable[[], None]
    before: ast.AST
    after: ast.AST


def _replace_in_parent(parent: ast.AST, old: ast.AST, new: ast.AST) -> Callable[[], None]:
    def apply() -> None:
        for name, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, name, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return
        raise AssertionError("node not found in its parent")
    return apply


def _setattr(node: ast.AST, name: str, value: object) -> Callable[[], None]:
    return lambda: setattr(node, name, value)


def _set_item(items: list, i: int, value: object) -> Callable[[], None]:
    return lambda: items.__setitem__(i, value)


def _mutations(node: ast.AST, parent: ast.AST) -> Iterator[tuple[str, Callable[[], None], ast.AST, ast.AST]]:
    """The mutations of one node: (what changes, how to change it, the text it changes before, after)."""
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BINOP:
        new = _BINOP[type(node.op)]
        yield f"`{_SYMBOL[type(node.op)]}` -> `{_SYMBOL[new]}`", _setattr(node, "op", new()), node, node
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            new = _CMPOP[type(op)]
            yield f"`{_SYMBOL[type(op)]}` -> `{_SYMBOL[new]}`", _set_item(node.ops, i, new()), node, node
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        yield f"`{_SYMBOL[type(node.op)]}` -> `{_SYMBOL[new]}`", _setattr(node, "op", new()), node, node
    elif isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.UAdd):
        sym = {ast.Not: "not ", ast.USub: "-", ast.Invert: "~"}[type(node.op)]
        yield f"`{sym}x` -> `x`", _replace_in_parent(parent, node, node.operand), node, node.operand
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            yield f"`{v}` -> `{not v}`", _setattr(node, "value", not v), node, node
        elif isinstance(v, (int, float)):
            yield f"`{v!r}` -> `{v + 1!r}`", _setattr(node, "value", v + 1), node, node
        elif isinstance(v, str) and not any(c.isspace() for c in v):
            yield f"`{v!r}` -> `{'XX' + v + 'XX'!r}`", _setattr(node, "value", "XX" + v + "XX"), node, node
    elif isinstance(node, ast.Name) and node.id in _SWAP_NAMES and isinstance(parent, ast.Call) and parent.func is node:
        yield (f"`{node.id}(...)` -> `{_SWAP_NAMES[node.id]}(...)`", _setattr(node, "id", _SWAP_NAMES[node.id]),
               parent, parent)
    elif isinstance(node, (ast.Break, ast.Continue)):
        new = ast.copy_location(ast.Continue() if isinstance(node, ast.Break) else ast.Break(), node)
        yield (f"`{type(node).__name__.lower()}` -> `{type(new).__name__.lower()}`",
               _replace_in_parent(parent, node, new), node, new)
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        new = ast.copy_location(ast.Pass(), node)
        yield "the call removed (`pass`)", _replace_in_parent(parent, node, new), node, new
    if isinstance(node, (ast.If, ast.While, ast.IfExp)) and isinstance(
            node.test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
        negated = ast.copy_location(ast.UnaryOp(op=ast.Not(), operand=node.test), node.test)
        yield "the condition negated (`not ...`)", _setattr(node, "test", negated), node.test, negated


def _is_docstring(node: ast.AST, parent: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            and isinstance(parent, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and parent.body and parent.body[0] is node)


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _scope_statements(tree: ast.Module, scope: list[str | tuple[str, str, str]], source: str) -> list[ast.AST]:
    """The nodes a scope names: whole functions, or a run of one function's statements."""
    defs: dict[str, ast.AST] = {}
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[top.name] = top
        elif isinstance(top, ast.ClassDef):
            for item in top.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs[f"{top.name}.{item.name}"] = item
    out: list[ast.AST] = []
    for entry in scope:
        name, first, last = (entry, None, None) if isinstance(entry, str) else entry
        if name not in defs:
            raise SystemExit(f"mutation target: no function {name!r}; update TARGETS in {Path(__file__).name}")
        if first is None:
            out.append(defs[name])
            continue
        body = defs[name].body
        texts = [ast.get_source_segment(source, s) or "" for s in body]
        try:
            i = next(k for k, t in enumerate(texts) if t.startswith(first))
            j = next(k for k, t in enumerate(texts) if k >= i and t.startswith(last))
        except StopIteration:
            raise SystemExit(f"mutation target: {name} has no statements from {first!r} to {last!r}; "
                             f"update TARGETS in {Path(__file__).name}") from None
        out += body[i:j + 1]
    return out


def _sites(tree: ast.Module, source: str, scope: list | None) -> list[_Site]:
    """Every mutation site of ``tree`` (within ``scope``), in a fixed order."""
    # (a function's defaults and decorators run at import, its body when called; a run of statements
    # of a function body, when called)
    roots = [(tree, True)] if scope is None else [
        (node, isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))) for node in _scope_statements(tree, scope, source)]
    sites: list[_Site] = []

    def visit(node: ast.AST, parent: ast.AST | None, stmt: ast.stmt | None, at_import: bool, quiet: bool,
              default_of: int | None) -> None:
        if _is_docstring(node, parent) or isinstance(node, ast.JoinedStr):
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        if isinstance(node, ast.stmt):
            stmt = node
        if isinstance(node, ast.Raise) or (isinstance(node, ast.Call) and _call_name(node) in _MESSAGE_CALLS):
            quiet = True  # its strings are messages
        for description, apply, before, after in _mutations(node, parent):
            if not (quiet and isinstance(node, ast.Constant) and isinstance(node.value, str)):
                sites.append(_Site(node, stmt, at_import, default_of, description, apply, before, after))
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns"):
                continue  # annotations are strings under `from __future__ import annotations`
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                a_def = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if a_def and name == "args":  # defaults: used by the calls that leave them out
                    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
                    visit(child, node, stmt, False, quiet, first)
                else:
                    visit(child, node, stmt, at_import and not (a_def and name == "body"), quiet, default_of)

    for root, at_import in roots:
        visit(root, None if root is tree else _parent_of(tree, root), None, at_import, False, None)
    return sites


def _parent_of(tree: ast.AST, child: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        for _, value in ast.iter_fields(node):
            if value is child or (isinstance(value, list) and any(v is child for v in value)):
                return node
    raise AssertionError("no parent")


def _module_name(path: str) -> str:
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def _load(path: str) -> tuple[str, ast.Module]:
    source = (ROOT / path).read_text()
    return source, ast.parse(source, filename=str(ROOT / path))


def mutants_of(target: Target) -> list[Mutant]:
    out = []
    for path, scope in target.files.items():
        source, tree = _load(path)
        per_line: dict[int, int] = {}
        for k, site in enumerate(_sites(tree, source, scope)):
            line = site.node.lineno
            per_line[line] = per_line.get(line, 0) + 1
            first = min(line, site.stmt.lineno if site.stmt is not None else line)
            end = site.node.end_lineno or line
            out.append(Mutant(f"{Path(path).stem}:{line}.{per_line[line]}", path, _module_name(path), line,
                              (first, end), site.at_import, site.default_of, site.description, k))
    return out


def mutated_code(m: Mutant) -> tuple[object, str, str]:
    """The mutant's code object, and its node's text before and after."""
    source, tree = _load(m.path)
    site = _sites(tree, source, TARGETS_BY_PATH[m.path])[m.index]
    node = site.before
    before = ast.get_source_segment(source, node) or ast.unparse(node)
    site.apply()
    ast.fix_missing_locations(tree)
    after = ast.unparse(site.after)
    if node.lineno == node.end_lineno:  # the whole line, the change in place
        line = source.splitlines()[node.lineno - 1].encode()
        before, after = line.decode(), (line[:node.col_offset] + after.encode() + line[node.end_col_offset:]).decode()
    return compile(tree, str(ROOT / m.path), "exec"), " ".join(before.split()), " ".join(after.split())


TARGETS_BY_PATH: dict[str, list | None] = {p: s for t in TARGETS.values() for p, s in t.files.items()}


# -- running -----------------------------------------------------------------------------------

class _MemoryModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module's mutated code, compiled in memory, under its own name and file."""

    def __init__(self, name: str, path: Path, code: object) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec):  # noqa: ANN001
        return None

    def exec_module(self, module) -> None:  # noqa: ANN001
        exec(self.code, module.__dict__)


class _Tracer:
    """Which lines of the target files each test executes (the baseline's map for test selection)."""

    def __init__(self, files: set[str]) -> None:
        self.files = files
        self.current = "<outside>"
        self.lines: dict[str, set[tuple[str, int]]] = {}

    def __call__(self, frame, event, arg):  # noqa: ANN001
        if frame.f_code.co_filename not in self.files:
            return None
        seen = self.lines.setdefault(self.current, set())
        seen.add((frame.f_code.co_filename, -frame.f_code.co_firstlineno))  # a call of this function

        def local(frame, event, arg):  # noqa: ANN001
            if event == "line":
                self.lines.setdefault(self.current, set()).add((frame.f_code.co_filename, frame.f_lineno))
            return local
        return local


class _Plugin:
    """In the child: keep the chosen tests in the chosen order; note durations and the first failure."""

    def __init__(self, order: list[str] | None, exclude: tuple[str, ...], tracer: _Tracer | None) -> None:
        self.order, self.exclude, self.tracer = order, exclude, tracer
        self.durations: dict[str, float] = {}
        self.failed: list[str] = []
        self.selected: list[str] = []

    def pytest_collection_modifyitems(self, session, config, items) -> None:  # noqa: ANN001
        kept = [i for i in items if not any(x in i.nodeid for x in self.exclude)]
        if self.order is not None:
            rank = {n: k for k, n in enumerate(self.order)}
            kept = sorted((i for i in kept if i.nodeid in rank), key=lambda i: rank[i.nodeid])
        deselected = [i for i in items if i not in kept]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = kept
        self.selected = [i.nodeid for i in kept]

    def pytest_runtest_protocol(self, item, nextitem):  # noqa: ANN001
        if self.tracer is not None:
            self.tracer.current = item.nodeid
        return None

    def pytest_collectreport(self, report) -> None:  # noqa: ANN001
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(f"{report.nodeid} (collection)")

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)


def _child(target: Target, order: list[str] | None, memory: _MemoryModule | None, trace: bool, result: Path,
           log: Path) -> None:
    """In the forked child: run the tests, write what happened to ``result``, exit with pytest's status."""
    import pytest

    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if memory is not None:
        sys.meta_path.insert(0, memory)
    tracer = None
    if trace:
        tracer = _Tracer({str(ROOT / p) for p in target.files})
        sys.settrace(tracer)
        threading.settrace(tracer)
    plugin = _Plugin(order, target.exclude, tracer)
    files = target.tests if order is None else sorted({t.split("::")[0] for t in order}, key=target.tests.index)
    # -n 0: in this process (the suite's addopts start xdist workers, which would import the file on disk)
    args = ["-q", "-p", "no:cacheprovider", "-n", "0", "-W", "ignore", "--rootdir", str(ROOT), *files]
    if not trace:
        args.insert(0, "-x")
    try:
        rc = int(pytest.main(args, plugins=[plugin]))
    except BaseException as e:  # noqa: BLE001 - anything the mutant raises kills it
        print(f"mutation runner: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 3
    sys.settrace(None)
    out = {"rc": rc, "failed": plugin.failed, "durations": plugin.durations, "selected": plugin.selected}
    if tracer is not None:
        out["lines"] = {t: sorted(ls) for t, ls in tracer.lines.items()}
    result.write_text(json.dumps(out))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _fork(timeout: float | None, work: Path, **kwargs) -> tuple[dict | None, bool]:  # noqa: ANN003
    """Run :func:`_child` in a fork; returns (its result, whether it timed out)."""
    result = work / f"result-{os.getpid()}.json"  # per runner: several may share ``work``
    result.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _child(result=result, **kwargs)
        finally:
            os._exit(4)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if deadline is not None and time.monotonic() > deadline:
            for sig in (signal.SIGKILL,):
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
            os.waitpid(pid, 0)
            return None, True
        time.sleep(0.05)
    return (json.loads(result.read_text()) if result.exists() else None), False


def _cache_key(target: Target) -> str:
    h = hashlib.sha256()
    files = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
    files += [ROOT / t for t in target.tests] + [Path(__file__)]
    for f in files:
        h.update(str(f).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def baseline(name: str, target: Target, work: Path) -> dict:
    """The target's tests, unmutated and traced: durations, and the lines each test executes."""
    cache = work / f"baseline-{name}-{_cache_key(target)}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    print(f"[{name}] baseline: {', '.join(target.tests)} (traced) ...", flush=True)
    t0 = time.monotonic()
    log = work / f"baseline-{name}-{os.getpid()}.log"
    out, _ = _fork(None, work, target=target, order=None, memory=None, trace=True, log=log)
    if out is None or out["rc"] != 0:
        raise SystemExit(f"[{name}] the unmutated tests do not pass (see {log}): "
                         f"{out and out['failed']}")
    print(f"[{name}] baseline: {len(out['selected'])} tests pass in {time.monotonic() - t0:.0f} s", flush=True)
    cache.write_text(json.dumps(out))
    return out


def select(m: Mutant, base: dict) -> list[str]:
    """The baseline's tests that execute the mutant's lines, fastest first (every test: at import)."""
    durations = base["durations"]
    path = str(ROOT / m.path)
    lo, hi = m.lines
    if "by_test" not in base:
        base["by_test"] = {t: {(f, ln) for f, ln in lines} for t, lines in base["lines"].items()}
    if m.default_of is not None:  # the tests that call its function (the tracer notes a call as -first line)
        runs = {t for t, lines in base["by_test"].items() if (path, -m.default_of) in lines}
    else:
        want = {(path, ln) for ln in range(lo, hi + 1)}
        runs = {t for t, lines in base["by_test"].items() if not want.isdisjoint(lines)}
    if m.at_import or (m.default_of is None and "<outside>" in runs):
        runs = set(base["selected"])
    return sorted((t for t in runs if t in durations), key=lambda t: (durations[t], t))


def run_target(name: str, only: list[str] | None, timeout: float | None, work: Path) -> dict:
    target = TARGETS[name]
    missing = [t for t in target.tests if not (ROOT / t).exists()]
    if missing:  # (a tree from before a test file was written: its score without it)
        print(f"[{name}] not in this tree, left out: {', '.join(missing)}", flush=True)
        target = replace(target, tests=tuple(t for t in target.tests if t not in missing))
    base = baseline(name, target, work)
    mutants = [m for m in mutants_of(target) if only is None or m.id in only]
    rows = []
    t0 = time.monotonic()
    print(f"[{name}] {len(mutants)} mutants", flush=True)
    for k, m in enumerate(mutants, 1):
        tests = select(m, base)
        row = {"id": m.id, "description": m.description, "line": (ROOT / m.path).read_text().splitlines()[m.line - 1]
               .strip(), "tests": len(tests)}
        if not tests:
            row.update(status="survived", why="not run by any test")
        else:
            limit = timeout or 3 * sum(base["durations"][t] for t in tests) + 20
            code, _, _ = mutated_code(m)
            t1 = time.monotonic()
            out, timed_out = _fork(limit, work, target=target, order=tests,
                                   memory=_MemoryModule(m.module, ROOT / m.path, code), trace=False,
                                   log=work / f"mutant-{os.getpid()}.log")
            row["seconds"] = round(time.monotonic() - t1, 1)
            if timed_out:
                row.update(status="killed", why=f"timeout ({limit:.0f} s)")
            elif out is None:
                row.update(status="killed", why="the test process died")
            elif out["rc"] == 0:
                row.update(status="survived", why=f"{len(tests)} tests pass")
            elif out["rc"] == 1:
                row.update(status="killed", why=f"fails {out['failed'][0] if out['failed'] else '?'}")
            elif out["rc"] == 5:
                row.update(status="error", why="no test ran (pytest status 5)")
            else:
                row.update(status="killed", why=f"the tests stop (pytest status {out['rc']}: an import or "
                                                f"collection error)")
        rows.append(row)
        mark = {"killed": ".", "survived": "S", "error": "E"}[row["status"]]
        print(f"  {k:4d}/{len(mutants)} {mark} {m.id:26s} {m.description:38s} {row['why']} "
              f"[{row.get('seconds', 0)} s]", flush=True)
    killed = sum(r["status"] == "killed" for r in rows)
    timeouts = sum(r["why"].startswith("timeout") for r in rows)
    summary = {"target": name, "killed": killed, "total": len(rows), "timeouts": timeouts,
               "minutes": round((time.monotonic() - t0) / 60, 1), "rows": rows}
    print(f"[{name}] score {killed}/{len(rows)} killed ({timeouts} by timeout) in {summary['minutes']} min", flush=True)
    survivors = [r for r in rows if r["status"] != "killed"]
    if survivors:
        print(f"[{name}] survivors:")
        for r in survivors:
            print(f"  {r['id']:26s} {r['description']:38s} | {r['line'][:90]}  ({r['why']})")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("targets", nargs="*", metavar="TARGET", help=f"one or more of: {', '.join(TARGETS)}")
    p.add_argument("--all", action="store_true", help="every target")
    p.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    p.add_argument("--show", nargs="+", metavar="ID", help="show mutants: the line, the node before and after")
    p.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    p.add_argument("--timeout", type=float, help="seconds per mutant (default: 3x its tests' baseline time + 20 s)")
    p.add_argument("--json", type=Path, help="write every mutant's outcome here")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mixprec-mutation",
                   help="baseline caches and logs (default: %(default)s)")
    a = p.parse_args(argv)
    names = list(TARGETS) if a.all else list(a.targets)
    if a.show:
        by_id = {m.id: m for t in TARGETS.values() for m in mutants_of(t)}
        for i in a.show:
            m = by_id[i]
            _, before, after = mutated_code(m)
            print(f"{i} ({m.path}:{m.line}) {m.description}\n  - {before}\n  + {after}")
        return 0
    if not names or set(names) - set(TARGETS):
        p.error(f"name one or more targets ({', '.join(TARGETS)}), or --all")
    if a.list:
        for n in names:
            ms = mutants_of(TARGETS[n])
            print(f"[{n}] {len(ms)} mutants")
            for m in ms:
                print(f"  {m.id:26s} {m.description:38s} {'(import) ' if m.at_import else ''}"
                      f"{'(default) ' if m.default_of else ''}"
                      f"{(ROOT / m.path).read_text().splitlines()[m.line - 1].strip()[:80]}")
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    os.chdir(ROOT)
    a.work.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("mixprec")
    if spec is None or Path(spec.origin).resolve() != (ROOT / "src" / "mixprec" / "__init__.py").resolve():
        raise SystemExit(f"mixprec resolves to {spec and spec.origin}, not this tree's src/")
    # Imported once here, before any fork (with pytest's plugins: hypothesis' takes a second); mixprec
    # and the tests are imported by each child.
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    for plugin in importlib.metadata.entry_points(group="pytest11"):
        try:
            importlib.import_module(plugin.value.split(":")[0])
        except Exception:  # noqa: BLE001 - a plugin that fails to import fails in the child too, said there
            pass
    importlib.import_module("hypothesis")
    summaries = [run_target(n, a.only, a.timeout, a.work) for n in names]
    print("\nscores (killed / total):")
    for s in summaries:
        print(f"  {s['target']:16s} {s['killed']}/{s['total']} ({s['timeouts']} by timeout), {s['minutes']} min")
    if a.json:
        a.json.write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # (--list piped into head)
        sys.exit(0)

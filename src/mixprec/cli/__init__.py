"""The ``mixprec`` command line: one module per subcommand, registered here."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator

from mixprec.cli import bench, demo, doctor, env, run, train

_SUBCOMMANDS = {"demo": demo, "train": train, "bench": bench, "doctor": doctor, "env": env, "run": run}

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Fast, safe mixed-precision training for PyTorch.",
        epilog="Examples:\n  mixprec demo\n  mixprec train examples/pycode-tiny.toml\n  mixprec env --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _SUBCOMMANDS.values():
        module.register(sub)
    return parser


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the mixprec package's folder


def _is_mixprec_warning(category: type[Warning], filename: str) -> bool:
    """Whether a warning is mixprec's own: of one of mixprec's categories, or raised in its code."""
    if (category.__module__ or "").split(".")[0] == "mixprec":
        return True
    return os.path.abspath(filename or "").startswith(_PACKAGE + os.sep)


@contextlib.contextmanager
def _warnings_as_sentences() -> Iterator[None]:
    """Show mixprec's own warnings as ``mixprec: warning: ...`` while the command runs, every other
    warning (the user's program's, transformers'...) as the process showed it before (Python's
    ``path:line: Category: message``), and put back ``warnings.showwarning`` after it (``main``
    may be called from a program)."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not _is_mixprec_warning(category, filename):  # the program's own: its category and source line kept
            previous(message, category, filename, lineno, file, line)
            return
        # On the command line mixprec's warning is a sentence for the user, not a source location.
        print(f"mixprec: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def main(argv: list[str] | None = None) -> int:
    """Run the ``mixprec`` command line; returns the exit code.

    While it runs, mixprec's own warnings print as one ``mixprec: warning: ...`` line on stderr and
    every other one as Python prints it; the process's ``warnings.showwarning`` is restored when it
    returns or raises.
    """
    with _warnings_as_sentences():
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # A config file comes right after the command; the --flags after it may be overrides that
    # argparse does not know, and must not be taken for the file's name.
    config = None
    if len(argv) > 1 and argv[0] in ("train", "doctor") and not argv[1].startswith("-"):
        config = argv.pop(1)
    target = None
    if argv and argv[0] == "run":  # what follows the script is the script's, not ours
        argv, target = run.split_argv(argv)
    args, extra = parser.parse_known_args(argv)
    if target is not None:
        args.target = target
    if config is not None:
        args.config = config
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "accepts_overrides", False):
        return int(args.func(args, extra) or 0)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

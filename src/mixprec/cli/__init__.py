"""The ``mixprec`` command line: one module per subcommand, registered here."""

from __future__ import annotations

import argparse
import sys

from . import bench, demo, env, train

_SUBCOMMANDS = {"demo": demo, "train": train, "bench": bench, "env": env}

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


def main(argv: list[str] | None = None) -> int:
    """Run the ``mixprec`` command line; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
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

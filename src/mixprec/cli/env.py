"""``mixprec env``: what this machine offers for each precision."""

from __future__ import annotations

import argparse
import json

from mixprec.hardware import environment_report
from mixprec.precision.names import CANONICAL_PRECISIONS

_PRECISIONS = tuple(p for p in CANONICAL_PRECISIONS if p != "auto")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env",
        help="show torch, devices and which precisions are native, emulated or unsupported here",
        description="Show torch, the devices, their capability flags, and for each precision whether "
        "it is native, emulated or unsupported here, with what 'auto' would pick and why.",
        epilog="Examples:\n  mixprec env\n  mixprec env --json > env.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def format_report(report: dict) -> str:
    """The environment report as an aligned text table."""
    lines = [
        f"python   {report['python']}",
        f"torch    {report['torch']}" + (f" (CUDA {report['cuda']})" if report["cuda"] else " (no CUDA)"),
        f"default  {report['default_device']}",
        f"auto     {report['auto']['precision']}: {report['auto']['reason']}",
        "",
    ]
    for dev in report["devices"]:
        cc = dev["compute_capability"]
        lines.append(f"{dev['device']}: {dev['name']}" + (f" (compute capability {cc[0]}.{cc[1]})" if cc else ""))
        flags = "  ".join(f"{k}={'yes' if v else 'no'}" for k, v in dev["flags"].items())
        lines.append(f"  flags: {flags}")
        lines.append(f"  {'precision':<12} {'support':<12} note")
        for prec in _PRECISIONS:
            lines.append(f"  {prec:<12} {dev['support'].get(prec, 'unsupported'):<12} {dev['reasons'].get(prec, '')}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def run(args: argparse.Namespace) -> int:
    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report), end="" if not args.json else "\n")
    return 0

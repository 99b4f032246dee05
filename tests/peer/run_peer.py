"""Run the anchors' own test suites against the anchors and against mixprec (issue 14's ``peer`` target).

    .venv/bin/python tests/peer/run_peer.py                      # every suite, anchor and mixprec (~4 min)
    .venv/bin/python tests/peer/run_peer.py --suite hf --only mixprec -v   # one suite, mixprec only, reasons

The suites, their import swap and their summariser are the shared ones (``../shared/peer-suites``,
or ``$MIXPREC_PEER_SUITES``); this script runs their plain tier (users do not adapt their code),
prints one line per suite, ``suite: anchor N/M, mixprec K/M``, then the tests mixprec fails on
purpose (``tests/peer/expected_failures/*.txt``, each with its reason) and every other failure.
It needs the ``hf`` extra (accelerate, transformers, datasets) and ``expecttest``/``parameterized``.
Its exit status is 1 when a mixprec test fails that is not an expected failure, or when an
expected failure passes (the list is then stale), 0 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED = Path(os.environ.get("MIXPREC_PEER_SUITES", ROOT.parent / "shared" / "peer-suites"))
S = SHARED / "suites"
ACC_SRC = S / "accelerate" / "accelerate-src-16cb6eb" / "src"
SUITES = {
    "torch": "torch GradScaler CPU tests",
    "acc-scripts": "accelerate test scripts, 1 process",
    "acc-tests": "accelerate tests/ (accelerator, optimizer, scheduler, state_checkpointing)",
    "hf": "transformers Trainer subset",
}
ACC_SCRIPTS = ("test_script", "test_sync", "test_distributed_data_loop")
ACC_TESTS = ("test_accelerator", "test_optimizer", "test_scheduler", "test_state_checkpointing")


def _env(pythonpath: list[Path], tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_DISABLED="true",
               PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath), **extra)
    return env


def _pytest(args: list[str], cwd: Path, env: dict[str, str], xml: Path, log: Path) -> None:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-W", "ignore::UserWarning",
           "-W", "ignore::DeprecationWarning", *args, f"--junitxml={xml}"]
    with open(log, "w") as out:
        subprocess.run(["timeout", "1500", *cmd], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _swap(kind: str, src: Path, dst: Path) -> None:
    subprocess.run([sys.executable, str(S / "swap_import.py"), kind, str(src), str(dst)], check=True,
                   stdout=subprocess.DEVNULL)


def run_suite(name: str, impl: str, work: Path) -> Path:
    """Run one suite for ``impl`` ("anchor" or "mixprec"); return its JUnit XML."""
    d = work / f"{name}_{impl}"
    tmp = d / "tmp"
    tmp.mkdir(parents=True)
    xml, log = work / f"{name}_{impl}.xml", work / f"{name}_{impl}.log"
    src = ROOT / "src"
    if name == "torch":
        text = (S / "torch" / "test_grad_scaling_cpu.py").read_text()
        if impl == "mixprec":
            text = re.sub(r"partial\(torch\.(amp\.)?GradScaler,", "partial(mixprec.LossScaler,", text)
            text = text.replace("= torch.GradScaler(", "= mixprec.LossScaler(")
            text = text.replace('torch.cuda.amp.GradScaler if "cuda" == device.type else torch.cpu.amp.GradScaler',
                                "mixprec.LossScaler")
            text = re.sub(r"^import torch$", "import torch\nimport mixprec", text, count=1, flags=re.M)
        (d / "test_grad_scaling_cpu.py").write_text(text)
        _pytest(["test_grad_scaling_cpu.py"], d, _env([src], tmp), xml, log)
    elif name in ("acc-scripts", "acc-tests"):
        (d / "scripts").mkdir()
        (d / "tests").mkdir()
        for f in ACC_SCRIPTS:
            s = ACC_SRC / "accelerate" / "test_utils" / "scripts" / f"{f}.py"
            _swap("accelerate", s, d / "scripts" / f"{f}.py") if impl == "mixprec" else shutil.copy(s, d / "scripts")
        env = _env([src, ACC_SRC], tmp, PEER_IMPL=impl, PEER_SCRIPTS_DIR=str(d / "scripts"))
        if name == "acc-scripts":
            shutil.copy(S / "accelerate" / "driver_scripts.py", d)
            _pytest(["driver_scripts.py"], d, env, xml, log)
        else:
            for f in ACC_TESTS:
                s = S / "accelerate" / "upstream" / "tests" / f"{f}.py"
                _swap("accelerate", s, d / "tests" / f"{f}.py") if impl == "mixprec" else shutil.copy(s, d / "tests")
            _pytest([f"{f}.py" for f in ACC_TESTS], d / "tests", env, xml, log)
    else:
        t = d / "tests" / "trainer"
        t.mkdir(parents=True)
        shutil.copy(S / "transformers" / "tests" / "__init__.py", d / "tests")
        for s in sorted((S / "transformers" / "tests" / "trainer").glob("*.py")):
            if impl == "mixprec" and s.name != "__init__.py":
                _swap("transformers", s, t / s.name)
            else:
                shutil.copy(s, t)
        _pytest(["tests/trainer"], d, _env([src], tmp), xml, log)
    return xml


def load(xml: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (status, one-line reason)}`` from a JUnit XML, with the shared summariser's test ids."""
    sys.path.insert(0, str(S))
    import summarize  # the shared one: same ids and reasons as ../shared/peer-suites/run.sh

    return summarize.load(str(xml)) if xml.exists() else {}


def expected_failures(folder: Path = HERE / "expected_failures") -> dict[str, str]:
    """``{test id: reason}`` from ``expected_failures/<anchor>.txt`` (``<id>  # <reason>`` per line)."""
    out = {}
    for line in (ln for f in sorted(folder.glob("*.txt")) for ln in f.read_text().splitlines()):
        line = line.strip()
        if line and not line.startswith("#"):
            test, _, why = line.partition("#")
            out[test.strip()] = why.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", action="append", choices=sorted(SUITES), help="run only this suite (repeatable)")
    p.add_argument("--only", choices=("anchor", "mixprec"), help="run only one side")
    p.add_argument("-v", "--verbose", action="store_true", help="print each unexpected failure's reason")
    p.add_argument("--keep", action="store_true", help="keep the work folder (swapped copies, logs)")
    args = p.parse_args(argv)
    if not S.is_dir():
        sys.exit(f"run_peer.py: no peer suites at {S}; set MIXPREC_PEER_SUITES to the peer-suites folder")
    work = Path(tempfile.mkdtemp(prefix="mixprec_peer_"))
    xfail = expected_failures()
    bad = 0
    for name in args.suite or list(SUITES):
        res = {impl: load(run_suite(name, impl, work)) for impl in ("anchor", "mixprec")
               if args.only in (None, impl)}
        counts = []
        for impl, cases in res.items():
            ran = [s for s, _ in cases.values() if s != "skipped"]
            counts.append(f"{impl} {sum(s == 'passed' for s in ran)}/{len(ran)}")
        mine = res.get("mixprec", {})
        failing = {t: why for t, (s, why) in mine.items() if s in ("failed", "error")}
        expected = {t for t in failing if t in xfail}
        stale = [t for t in xfail if t in mine and mine[t][0] == "passed"]
        line = f"{SUITES[name]}: " + ", ".join(counts)
        if mine:
            line += f" (expected failures {len(expected)}, unexpected {len(failing) - len(expected)})"
        print(line, flush=True)
        for t in sorted(failing):
            if t not in expected:
                bad += 1
                print(f"    FAIL {t}" + (f": {failing[t]}" if args.verbose else ""))
        for t in stale:
            bad += 1
            print(f"    PASSES, remove from expected_failures/: {t}")
    if args.keep:
        print(f"work folder: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""What every test shares: the GPU-only mechanism and common fixtures.

Models, datasets and the script/example paths are in ``toys.py`` (imported by name); this file
holds what pytest itself must see.

* ``@pytest.mark.soak`` marks long fault-injection runs, skipped unless selected (``-m soak``).
* ``@pytest.mark.gpu`` is the one mechanism for tests that need CUDA: they are skipped, with the
  reason, where ``torch.cuda.is_available()`` is false, and run unchanged on a GPU machine.
* The reference packages (``REFERENCES``: the installed transformers, accelerate, peft, torchao,
  datasets, schedulefree, trl, sentence-transformers and lightning the differential tests take their
  expected values from): a test whose reference is missing is skipped, except where ``MIXPREC_REQUIRE_REFERENCES=1`` (``.ci/run``
  sets it), where a missing one is an error that names it and the fix: the run stops before its
  first test, and a skip for a missing part of one (``torchao.float8``) is a failure.
* Under pytest-xdist (``-n auto``, in ``pyproject.toml``'s addopts) each worker takes its share
  of the cores for torch's intra-op threads, and the tests of a module that share a
  module-scoped fixture (a costly run made once) go to one worker (an ``xdist_group`` named by
  the module), so that it is made once.
* ``one_thread``: torch's intra-op threads limited to 1 for the test, restored after (many
  small steps, where a second thread only adds waiting on a shared machine).
* After each test, Accelerate's process-wide state (``PartialState``, ``AcceleratorState``), which
  mixprec's Accelerator sets up where Accelerate is imported, is reset, as Accelerate's own tests
  reset it: a test that builds Accelerate's Accelerator with another precision starts clean.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import toys

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker of ``-n N`` gets its share of the cores for torch's intra-op threads, so that N
    # workers do not each start a thread per core and wait on each other.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # the tests of a module sharing a module-scoped fixture run on one worker
        if not any(item.iter_markers("xdist_group")) and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if "soak" not in (config.option.markexpr or ""):
        soak = pytest.mark.skip(reason="a soak run (marked soak): select it with -m soak")
        for item in items:
            if "soak" in item.keywords:
                item.add_marker(soak)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` takes a fixture made once per module (under xdist, once per worker that
    runs one of its tests: twice, where two workers share them)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope == "module" for name in item.fixturenames
                                    for d in info.name2fixturedefs.get(name, ()))


#: The packages the differential tests compare against: a test whose reference is missing skips, or,
#: where REQUIRE is set (CI), fails. ``pip install -e ".[dev]"`` installs them all.
REFERENCES = ("transformers", "accelerate", "peft", "torchao", "datasets", "schedulefree", "trl",
              "sentence_transformers", "lightning")
REQUIRE = "MIXPREC_REQUIRE_REFERENCES"
FIX = 'install the test extras: pip install -e ".[dev]"'


def _references_required() -> bool:
    return os.environ.get(REQUIRE, "") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    if not _references_required():
        return
    missing = [name for name in REFERENCES if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(f"{REQUIRE} is set, and these reference packages are not installed: "
                                f"{', '.join(missing)} (the tests that compare against them would be skipped); {FIX}")


def _skip_for_a_missing_reference(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Where REQUIRE is set, turn ``report``, a skip for a missing reference module (a part of an
    installed package: ``torchao.float8``), into a failure that names it and the fix."""
    if not (report.skipped and _references_required()):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    missing = re.search(r"could not import '([\w.]+)'", reason)
    if missing and missing[1].split(".")[0] in REFERENCES:
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE} is set, and the reference module {missing[1]} is missing ({reason}); {FIX}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    _skip_for_a_missing_reference(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    _skip_for_a_missing_reference(report)
    return report


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@pytest.fixture
def disk(tmp_path):
    """A 3 MiB tmpfs mounted at ``tmp_path/"disk"``, lazily unmounted after the test."""
    if not sys.platform.startswith("linux"):
        pytest.skip("mounting a tmpfs needs Linux")
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount command here")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={toys.DISK_BYTES}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {mnt}: {(proc.stderr or proc.stdout).strip()}")
    try:
        assert shutil.disk_usage(mnt).total == toys.DISK_BYTES, "the tmpfs is not the size asked for"
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)

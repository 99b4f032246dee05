"""What every test shares: the GPU-only mechanism and common fixtures.

Models, datasets and the script/example paths are in ``toys.py`` (imported by name); this file
holds what pytest itself must see.

* ``@pytest.mark.gpu`` is the one mechanism for tests that need CUDA: they are skipped, with the
  reason, where ``torch.cuda.is_available()`` is false, and run unchanged on a GPU machine.
* ``one_thread``: torch's intra-op threads limited to 1 for the test, restored after (many
  small steps, where a second thread only adds waiting on a shared machine).
* After each test, Accelerate's process-wide state (``PartialState``, ``AcceleratorState``), which
  mixprec's Accelerator sets up where Accelerate is imported, is reset, as Accelerate's own tests
  reset it: a test that builds Accelerate's Accelerator with another precision starts clean.
"""

from __future__ import annotations

import sys

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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

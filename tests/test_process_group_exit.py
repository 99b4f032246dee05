"""The process group mixprec creates is destroyed at interpreter exit, and only that one.

One process stands in for a rank: ``init_from_env`` sees ``WORLD_SIZE=2`` while the group it
creates is a real one-process gloo group (``dist.init_process_group`` is wrapped). The end-to-end
check, a torchrun job restarted after a SIGKILL that must exit 0, is in test_fsdp.py.
"""

import atexit

import pytest
import torch
import torch.distributed as dist

from mixprec.distributed import groups


@pytest.fixture
def as_rank_0_of_2(monkeypatch):
    """``init_from_env`` as torchrun's rank 0 of 2; returns the exit handlers it registers."""
    real_init = dist.init_process_group

    def one_process_group(backend, rank, world_size, timeout, **kwargs):
        assert (backend, rank, world_size) == ("gloo", 0, 2)
        real_init(backend="gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(dist, "init_process_group", one_process_group)
    handlers = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: handlers.append((fn, args)))
    yield handlers
    monkeypatch.undo()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(handlers) -> None:
    for fn, args in reversed(handlers):  # as atexit does
        fn(*args)


def test_the_group_init_from_env_creates_outlives_training_and_is_destroyed_at_exit(as_rank_0_of_2):
    groups.init_from_env("cpu")
    assert len(as_rank_0_of_2) == 1 and dist.is_initialized()
    t = torch.ones(2)
    dist.all_reduce(t)  # still usable after train(), until the interpreter exits
    run(as_rank_0_of_2)
    assert not dist.is_initialized()
    run(as_rank_0_of_2)  # already destroyed: nothing to do, nothing raised


def test_a_group_destroyed_and_replaced_by_the_script_is_left_alone(as_rank_0_of_2):
    groups.init_from_env("cpu")
    dist.destroy_process_group()
    dist.distributed_c10d.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    mine = dist.group.WORLD
    run(as_rank_0_of_2)
    assert dist.is_initialized() and dist.group.WORLD is mine


def test_a_group_the_script_created_is_not_destroyed_by_mixprec(as_rank_0_of_2):
    dist.distributed_c10d.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert groups.init_from_env("cpu").rank == 0
    assert as_rank_0_of_2 == []  # nothing registered


def test_the_exit_handler_never_raises(as_rank_0_of_2, monkeypatch):
    groups.init_from_env("cpu")

    def broken(group=None):
        raise RuntimeError("the store is gone")

    monkeypatch.setattr(dist, "destroy_process_group", broken)
    run(as_rank_0_of_2)  # swallowed: the exit's status stays the script's


def test_one_process_creates_no_group_and_registers_nothing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args: registered.append(fn))
    assert not groups.init_from_env("cpu").is_distributed
    assert registered == [] and not dist.is_initialized()

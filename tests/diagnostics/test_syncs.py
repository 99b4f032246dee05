"""Host-device syncs: what the counter sees, and how many syncs each kind of training step makes."""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mixprec import Accelerator, Trainer, TrainerCallback, TrainingArguments
from mixprec.diagnostics import count_host_syncs, host_side_tensors

from toys import Classifier, blobs

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")

x = torch.tensor([1.0, 0.0, 2.0])
s = torch.tensor(3.0)
i = torch.tensor(2)

# Every read the counter claims, with the name it records.
READS = {
    "item": lambda: s.item(),
    "__bool__": lambda: 1 if s > 0 else 0,
    "__float__": lambda: float(s),
    "__int__": lambda: int(s),
    "__index__": lambda: range(i),
    "__complex__": lambda: complex(s),
    "__format__": lambda: f"{s:.2f}",
    "__repr__": lambda: str(x),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "__array__": lambda: np.asarray(x),
    "aten._local_scalar_dense": lambda: torch.full((2,), s),  # a tensor where torch wants a number
    "aten.nonzero": lambda: torch.where(x > 0),
    "aten.masked_select": lambda: x.masked_select(x > 0),
    "aten._unique2": lambda: torch.unique(x),
    "aten.unique_dim": lambda: torch.unique(x, dim=0),
    "aten.unique_consecutive": lambda: torch.unique_consecutive(x),
    "aten.equal": lambda: torch.equal(x, x),
    "aten.allclose": lambda: torch.allclose(x, x),
    "aten.bincount": lambda: torch.bincount(i.reshape(1)),
    "aten.repeat_interleave": lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 0])),
    "aten.index": lambda: x[x > 0],
    "aten.index_put_": lambda: x.clone().__setitem__(x > 5, 0.0),
}


def test_the_counter_is_a_diagnostic_and_the_bench_still_offers_it():
    import mixprec.apps.bench as bench
    import mixprec.diagnostics as diagnostics

    for name in ("count_host_syncs", "host_side_tensors", "HostSyncs", "SyncEvent"):
        assert getattr(bench, name) is getattr(diagnostics, name) and name in diagnostics.__all__
    assert count_host_syncs.__module__ == "mixprec.diagnostics.syncs"


@pytest.mark.parametrize("what", READS)
def test_each_kind_of_read_counts_once_under_its_name_and_where_it_was_made(what):
    with count_host_syncs("cpu") as syncs:
        READS[what]()
    assert syncs.count == 1
    assert syncs.events[0].what == what
    assert syncs.events[0].where.startswith(__file__ + ":")


@pytest.mark.parametrize("read", [lambda: torch.nonzero(x), lambda: torch.argwhere(x), lambda: x.nonzero()])
def test_every_spelling_of_nonzero_counts(read):
    with count_host_syncs("cpu") as syncs:
        read()
    assert [e.what for e in syncs.events] == ["aten.nonzero"]


def test_compute_shapes_and_sync_free_spellings_are_not_reads():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    inputs = torch.randn(16, 4)
    with count_host_syncs("cpu") as syncs:
        loss = model(inputs).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.repeat_interleave(x, torch.tensor([1, 2, 0]), output_size=3)  # the size is given
        x.repeat_interleave(2)
        x.masked_fill(x > 0, 0.0)
        torch.where(x > 0, x, -x)
        x[torch.tensor([0, 2])]
        torch.isfinite(x).all()
        _ = x.shape, len(x), x.device, x.dtype, x.numel()
        x.cpu()  # already on the host
    assert syncs.count == 0, syncs.events


def test_ignored_tensors_are_matched_by_identity():
    step = torch.tensor(5.0)
    with count_host_syncs("cpu", ignore=[step]) as syncs:
        step.item()
        float(step)
        step.clone().item()  # a copy is another tensor
        s.item()
    assert [e.what for e in syncs.events] == ["item", "item"]


def test_ignore_takes_only_tensors_and_says_what_to_pass():
    with pytest.raises(TypeError, match="host_side_tensors"):
        count_host_syncs("cpu", ignore=[torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])])


def test_reads_outside_the_block_are_not_counted_and_the_modes_are_gone_after_it():
    function_modes, dispatch_modes = torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
    s.item()
    with count_host_syncs("cpu") as syncs:
        pass
    s.item()
    with pytest.raises(ValueError), count_host_syncs("cpu"):
        raise ValueError("leaves through an exception")
    assert syncs.count == 0
    assert torch._C._len_torch_function_stack() == function_modes
    assert torch._C._len_torch_dispatch_stack() == dispatch_modes


def test_nested_counts_each_see_their_own_block():
    with count_host_syncs("cpu") as outer:
        s.item()
        with count_host_syncs("cpu", ignore=[s]) as inner:
            s.item()
            bool(x.sum())
        torch.nonzero(x)
    assert [e.what for e in inner.events] == ["__bool__"]
    assert [e.what for e in outer.events] == ["item", "item", "__bool__", "aten.nonzero"]


def test_a_counter_is_used_once():
    counter = count_host_syncs("cpu")
    with counter:
        pass
    with pytest.raises(RuntimeError, match="count_host_syncs"), counter:
        pass


def test_device_count_is_cuda_only():
    with count_host_syncs("cpu") as syncs:
        s.item()
    assert syncs.device_count is None and syncs.device_events is None
    assert "count=1" in repr(syncs) and "item: 1" in repr(syncs)


def test_counting_does_not_change_the_numbers():
    def train(counted: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        inputs, targets = torch.randn(16, 4), torch.randn(16, 1)
        for _ in range(3):
            with count_host_syncs("cpu") if counted else contextlib.nullcontext():
                (model(inputs) - targets).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))


# -- host_side_tensors ----------------------------------------------------------------------
def test_host_side_tensors_are_the_optimizers_step_counters_through_wrappers():
    acc = Accelerator(mixed_precision="fp32", cpu=True)
    model = torch.nn.Linear(4, 2)
    opt = acc.prepare(torch.optim.AdamW(model.parameters(), foreach=True))
    assert host_side_tensors(opt) == []  # the counters are made by the first step
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    steps = host_side_tensors(opt)
    assert len(steps) == 2
    assert {id(t) for t in steps} == {id(opt.optimizer.state[p]["step"]) for p in model.parameters()}


def test_host_side_tensors_wants_an_optimizer():
    with pytest.raises(TypeError, match="takes an optimizer"):
        host_side_tensors(torch.nn.Linear(2, 2))


# -- the Accelerator's step -----------------------------------------------------------------
def _step_syncs(precision: str, optimizer: str, *, clip: bool = False, scheduler: bool = False,
                ignore_host_side: bool = True, steps: int = 3, **acc_kwargs):
    """Per step after a warm-up one: the (what, file) of each sync."""
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision=precision, cpu=True, **acc_kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **{optimizer: True})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    model, opt, sched = acc.prepare(model, opt, sched)
    inputs, targets = torch.randn(16, 8), torch.randn(16, 1)

    def step():
        loss = (model(inputs).float() - targets).pow(2).mean()
        acc.backward(loss)
        if clip:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if scheduler:
            sched.step()
        opt.zero_grad()

    step()
    per_step = []
    for _ in range(steps):
        with count_host_syncs(acc.device, ignore=host_side_tensors(opt) if ignore_host_side else ()) as syncs:
            step()
        per_step.append(_named(syncs.events))
    return per_step


def _named(events) -> list[tuple[str, str, str]]:
    """(what, file name, source line) of each event."""
    out = []
    for e in events:
        path, line = e.where.rsplit(":", 1)
        out.append((e.what, Path(path).name, linecache.getline(path, int(line)).strip()))
    return out


@dataclasses.dataclass(frozen=True)
class _Read:
    """Equal to a ``_named`` triple with this read, in this file, on a line holding ``code``."""

    what: str
    file: str
    code: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, tuple) and other[:2] == (self.what, self.file) and self.code in other[2]


FOUND_INF_READ = _Read("item", "scaler.py", "found_inf_per_device")  # before a non-fused step: step or skip?
LAST_STEP_READ = _Read("item", "scaler.py", "_last_found_inf.item()")  # last_step_applied
INPUTS_FINITE_READ = _Read("__bool__", "nonfinite.py", "isfinite")  # a skipped step's inputs, all at once
COLLAPSE_READ = _Read("item", "scaler.py", "_consecutive.item()")  # the max_consecutive_skips check
STEP_COUNTER_READ = _Read("item", "compensated.py", ".item()")  # the compensated AdamW's CPU step counter


@pytest.mark.parametrize("clip", [False, True], ids=["", "clip"])
@pytest.mark.parametrize("precision, optimizer, expected", [
    ("fp16", "fused", []),  # the scaler hands found_inf to the fused kernel: it skips on the device
    ("fp16", "foreach", [FOUND_INF_READ]),
    ("bf16", "fused", []),
    ("fp32", "fused", []),
    ("bf16-true", "fused", []),  # replaced by the Kahan-compensated AdamW
    ("bf16-true", "foreach", []),
])
def test_accelerator_step_makes_the_syncs_we_promise(precision, optimizer, expected, clip):
    assert _step_syncs(precision, optimizer, clip=clip) == [expected] * 3


def test_bf16_true_compensated_adamw_reads_only_its_host_side_step_counters():
    per_step = _step_syncs("bf16-true", "fused", ignore_host_side=False)
    assert per_step == [[STEP_COUNTER_READ] * 4] * 3  # one per parameter tensor, all on the host by design


@pytest.mark.parametrize("precision, optimizer, expected", [
    ("fp16", "fused", [LAST_STEP_READ]),
    ("fp16", "foreach", [FOUND_INF_READ]),  # the step's own read already told: not read twice
    ("bf16", "fused", []),  # no scaler: every step is applied
    ("bf16-true", "fused", []),
])
def test_scheduler_reads_whether_the_fp16_step_was_applied_once(precision, optimizer, expected):
    # A skipped step must not advance the schedule, and the schedule is a Python object.
    assert _step_syncs(precision, optimizer, scheduler=True) == [expected] * 3


@pytest.mark.parametrize("scheduler", [False, True], ids=["", "scheduler"])
@pytest.mark.parametrize("optimizer, expected", [
    ("fused", [COLLAPSE_READ]),  # which also tells last_step_applied: a scheduler reads nothing more
    ("foreach", [FOUND_INF_READ]),  # the skip counter follows on the host from the step's read
])
def test_max_consecutive_skips_costs_at_most_one_read_per_update(optimizer, expected, scheduler):
    per_step = _step_syncs("fp16", optimizer, scheduler=scheduler, loss_scaler={"max_consecutive_skips": 5})
    assert per_step == [expected] * 3


# -- the Trainer --------------------------------------------------------------------------------
class _CountEachStep(TrainerCallback):
    """Counts the syncs from on_step_begin to on_step_end of every optimizer step."""

    def __init__(self) -> None:
        self.per_step: list[list] = []
        self._counter = None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        ignore = host_side_tensors(optimizer) if optimizer is not None else ()
        self._counter = count_host_syncs("cpu", ignore=ignore)
        self._counter.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self._counter.__exit__(None, None, None)
        self.per_step.append(_named(self._counter.events))


def _train(max_steps: int, **overrides):
    """A Trainer run that never logs nor saves: (syncs per step, syncs of the whole train(), its skipped steps)."""
    torch.manual_seed(0)
    kw = dict(bf16=True, logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True,
              use_cpu=True, max_grad_norm=1.0, max_steps=max_steps, per_device_train_batch_size=8)
    kw.update(overrides)
    each = _CountEachStep()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=Classifier(hidden=32), args=TrainingArguments(output_dir=out, **kw),
                          train_dataset=blobs(256), callbacks=[each])
        with count_host_syncs("cpu") as whole:
            trainer.train()
    return each.per_step, whole.count, trainer.state.skipped_steps


def test_trainer_bf16_steps_make_no_sync():
    per_step, _, _ = _train(5)
    assert per_step == [[]] * 5


def test_trainer_runs_of_different_lengths_make_the_same_syncs():
    # What a run costs once (the loader's seed and shuffle order, the final loss) cancels out.
    (_, short, _), (_, long, _) = _train(3), _train(9)
    assert long - short == 0


def test_trainer_fp16_step_reads_once_whether_to_advance_the_schedule():
    """An applied step reads once; a skipped one (the loss scale is calibrating) reads once more:
    whether its inputs are all finite (the bad-batch report), a single read for all of them."""
    per_step, _, skipped = _train(4, bf16=False, fp16=True)
    assert 0 < skipped < 4  # both kinds of step are seen
    assert per_step == [[LAST_STEP_READ, INPUTS_FINITE_READ]] * skipped + [[LAST_STEP_READ]] * (4 - skipped)


# -- CUDA --------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_fp16_fused_adamw_step_makes_no_sync_by_either_count():
    torch.manual_seed(0)
    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = acc.prepare(model, opt)
    inputs, targets = torch.randn(32, 64, device=acc.device), torch.randn(32, 1, device=acc.device)

    def step():
        loss = (model(inputs).float() - targets).pow(2).mean()
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    step()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with count_host_syncs(acc.device, ignore=host_side_tensors(opt)) as syncs:
        for _ in range(3):
            step()
    assert (syncs.count, syncs.device_count) == (0, 0), syncs.events
    assert torch.cuda.get_sync_debug_mode() == previous
    with count_host_syncs(acc.device) as syncs:  # and both counts see a sync where there is one
        inputs.sum().item()
        torch.nonzero(inputs > 0)
        inputs.cpu()
    assert syncs.count == syncs.device_count == 3, (syncs.events, syncs.device_events)

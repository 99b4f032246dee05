"""Hugging Face Accelerate's API on mixprec's Accelerator: what its users' code calls, checked here
(the anchors' own suites run in tests/peer/run_peer.py)."""

import json
import pickle

import pytest
import safetensors.torch
import torch
from torch.utils.data import DataLoader, TensorDataset

from mixprec import (
    Accelerator,
    CheckpointError,
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    LossScaler,
    ProjectConfiguration,
)


def parts(n=32, batch_size=4, shuffle=True):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DataLoader(TensorDataset(torch.randn(n, 3), torch.randn(n, 1)), batch_size=batch_size, shuffle=shuffle)
    return model, opt, dl


def train(acc, model, opt, dl, epochs=1, skip=0):
    for epoch in range(epochs):
        for x, y in (acc.skip_first_batches(dl, skip) if epoch == 0 and skip else dl):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()


def test_automatic_checkpoint_naming_rotates_only_after_the_new_checkpoint_is_complete(tmp_path, monkeypatch):
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path), total_limit=2,
                                                                    automatic_checkpoint_naming=True))
    model, opt, dl = acc.prepare(*parts())
    for _ in range(3):
        acc.save_state()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_1", "checkpoint_2"] and acc.save_iteration == 3
    # A save that fails half-way leaves both complete checkpoints and no debris.
    import mixprec.accelerator.checkpointer as ckpt

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "commit_checkpoint", boom)
    with pytest.raises(OSError):
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    monkeypatch.undo()
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state()  # the newest complete one
    assert model.weight.abs().sum() > 0


def test_a_missing_checkpoint_folder_is_a_file_not_found_error(tmp_path):
    acc = Accelerator(cpu=True)
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        acc.load_state(tmp_path / "nope")
    with pytest.raises(CheckpointError):
        acc.load_state(tmp_path / "nope")
    with pytest.raises(ValueError, match="automatic checkpoint naming"):
        acc.save_state()


def test_save_and_load_pre_hooks_join_the_atomic_checkpoint_and_can_be_removed(tmp_path):
    acc = Accelerator(cpu=True)
    model, opt, dl = acc.prepare(*parts())
    seen = {}

    def save_hook(models, weights, output_dir):
        assert len(models) == len(weights) == 1 and "weight" in weights[0]
        (__import__("pathlib").Path(output_dir) / "extra.json").write_text(json.dumps({"k": 1}))

    def load_hook(models, input_dir):
        seen["k"] = json.loads((__import__("pathlib").Path(input_dir) / "extra.json").read_text())["k"]

    hs, hl = acc.register_save_state_pre_hook(save_hook), acc.register_load_state_pre_hook(load_hook)
    acc.save_state(tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert "extra.json" in manifest["files"]  # hashed like the rest
    acc.load_state(tmp_path / "a")
    assert seen == {"k": 1}
    hs.remove()
    hl.remove()
    acc.save_state(tmp_path / "b")
    assert not (tmp_path / "b" / "extra.json").exists()


def two_models_saved_by_hooks(accelerator_cls, folder, seen):
    """Two models prepared on ``accelerator_cls``: a save hook writes the first itself and pops its
    weights (as peft users save only the adapter), a load hook loads it and pops it; what the hooks
    receive is recorded in ``seen``. Returns the accelerator and the models."""
    acc = accelerator_cls(cpu=True)
    torch.manual_seed(0)
    own, rest = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
    own, rest = acc.prepare(own, rest)

    def save_hook(models, weights, output_dir):
        seen.append(("save", len(models), [sorted(w) for w in weights]))
        if acc.is_main_process:
            torch.save(acc.unwrap_model(models[0]).state_dict(), f"{output_dir}/own.pt")
        weights.pop(0)

    def load_hook(models, input_dir):
        seen.append(("load", len(models)))
        acc.unwrap_model(models.pop(0)).load_state_dict(torch.load(f"{input_dir}/own.pt", weights_only=True))

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)
    return acc, own, rest


@pytest.mark.parametrize("anchor", [False, True])
def test_a_save_hook_that_pops_weights_keeps_them_out_and_the_load_hooks_load_them(tmp_path, anchor):
    """Accelerate's protocol, under Accelerate itself and under mixprec: the weights a save hook
    pops are not written (the models left are numbered again from 0); load_state runs the load
    hooks, and a model a hook popped needs no weights file. mixprec's checkpoint still verifies:
    the hook's file is in the manifest, the popped model's file simply is not."""
    accelerate = pytest.importorskip("accelerate") if anchor else None
    cls = accelerate.Accelerator if anchor else Accelerator
    seen = []
    try:
        acc, own, rest = two_models_saved_by_hooks(cls, tmp_path, seen)
        acc.save_state(str(tmp_path / "ckpt"))
        saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in (own, rest)]
        names = {p.name for p in (tmp_path / "ckpt").iterdir()}
        assert "own.pt" in names and not {"model_1.safetensors", "model_1.bin"} & names
        first = tmp_path / "ckpt" / ("model.safetensors" if anchor else "model_0.safetensors")
        assert safetensors.torch.load_file(str(first)).keys() == {"weight", "bias"}  # the second model's
        assert torch.equal(safetensors.torch.load_file(str(first))["weight"], saved[1]["weight"])
        if not anchor:
            manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["files"]
            assert "own.pt" in manifest and "model_1.safetensors" not in manifest
        with torch.no_grad():
            for m in (own, rest):
                for p in m.parameters():
                    p.zero_()
        acc.load_state(str(tmp_path / "ckpt"))
        assert all(torch.equal(m.state_dict()[k], s[k]) for m, s in zip((own, rest), saved) for k in s)
        assert seen == [("save", 2, [["bias", "weight"], ["bias", "weight"]]), ("load", 2)]
    finally:
        if anchor:
            accelerate.state.AcceleratorState._reset_state(True)


def test_load_state_verifies_the_files_a_load_hook_reads_and_names_a_model_no_hook_loaded(tmp_path):
    seen = []
    acc, own, rest = two_models_saved_by_hooks(Accelerator, tmp_path, seen)
    acc.save_state(tmp_path / "ckpt")
    fresh = Accelerator(cpu=True)
    fresh.prepare(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))  # no load hook pops the first model
    with pytest.raises(CheckpointError, match="model_1.safetensors is not listed.*a load hook must pop each model"):
        fresh.load_state(tmp_path / "ckpt")
    hooked = (tmp_path / "ckpt" / "own.pt").read_bytes()
    (tmp_path / "ckpt" / "own.pt").write_bytes(hooked[:-1] + bytes([hooked[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="own.pt"):  # before the hook reads it
        acc.load_state(tmp_path / "ckpt")
    assert seen[-1][0] == "save"


def test_split_between_processes_keeps_a_mapping_such_as_batch_encoding():
    from mixprec.accelerator.state import split_for_process

    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.arange(10).reshape(5, 2), "labels": torch.arange(5)})
    part = split_for_process(batch, 2, 1)
    assert isinstance(part, transformers.BatchEncoding)
    assert torch.equal(part["labels"], torch.tensor([3, 4])) and part["input_ids"].shape == (2, 2)


@pytest.mark.parametrize("safe", [True, False])
def test_save_model_shards_with_an_index_that_transformers_layout_expects(tmp_path, safe):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[1].weight = model[0].weight  # tied: stored once
    acc = Accelerator(cpu=True)
    acc.save_model(model, tmp_path, max_shard_size=300, safe_serialization=safe)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    index = json.loads((tmp_path / f"{stem}.{ext}.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and all(f.startswith(f"{stem}-") for f in files)
    state = {}
    for f in files:
        state.update(safetensors.torch.load_file(str(tmp_path / f)) if safe
                     else torch.load(tmp_path / f, weights_only=True))
    assert "1.weight" not in state and torch.equal(state["0.weight"], model[0].weight)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())


def test_register_for_checkpointing_lists_every_object_it_cannot_save():
    acc = Accelerator(cpu=True)
    with pytest.raises(ValueError) as e:
        acc.register_for_checkpointing(torch.ones(1), torch.nn.Linear(1, 1), 3)
    assert "Item at index 0" in str(e.value) and "Item at index 2" in str(e.value)
    assert "Item at index 1" not in str(e.value)


def test_state_and_gradient_state_are_the_accelerators_own():
    a, b = Accelerator(cpu=True, gradient_accumulation_steps=2), Accelerator(cpu=True)
    assert a.state.distributed_type == DistributedType.NO == "NO" and a.state.num_processes == 1
    assert a.gradient_state.num_steps == 2 and b.gradient_state.num_steps == 1  # not shared
    a.gradient_accumulation_steps = 4
    assert a.gradient_state.num_steps == 4
    with pytest.raises(AttributeError, match="'AcceleratorState' object has no attribute 'nope'"):
        a.state.nope  # noqa: B018
    a.state._reset_state()
    with pytest.raises(AttributeError, match="_reset_state"):
        a.num_processes  # noqa: B018
    assert b.num_processes == 1


def test_gradient_state_tracks_the_active_dataloader_and_its_end():
    acc = Accelerator(cpu=True)
    _, _, dl = parts(n=8)
    dl = acc.prepare(dl)
    assert acc.gradient_state.active_dataloader is None
    ends = []
    for _ in dl:
        assert acc.gradient_state.active_dataloader is dl
        ends.append(acc.gradient_state.end_of_dataloader)
    assert ends == [False, True] and acc.gradient_state.active_dataloader is None


def test_gradient_accumulation_plugin_and_no_sync():
    acc = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert acc.gradient_accumulation_steps == 2
    with pytest.raises(ValueError, match="not both"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, gradient_accumulation_plugin={"num_steps": 2})
    model = acc.prepare(torch.nn.Linear(2, 1))
    with acc.no_sync(model):  # one process: nothing to skip, but it is there
        pass


def test_scheduler_steps_once_per_process_with_the_optimizer_or_every_call_without():
    for with_opt in (True, False):
        acc = Accelerator(cpu=True, step_scheduler_with_optimizer=with_opt)
        model, opt, _ = parts()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 - n / 10)
        model, opt, sched = acc.prepare(model, opt, sched)
        opt._is_overflow = True  # Accelerate's flag: the step was skipped
        sched.step()
        assert sched.scheduler.last_epoch == (0 if with_opt else 1)


def test_trigger_and_process_decorators(capsys):
    acc = Accelerator(cpu=True)
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True and acc.check_trigger() is False
    acc.on_main_process(print)("main")
    acc.on_process(print, process_index=1)("never")
    assert capsys.readouterr().out == "main\n" and acc.is_last_process


def test_unwrap_model_keeps_torch_compile_by_default_as_accelerate():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(torch.nn.DataParallel(model))
    acc = Accelerator(cpu=True)
    assert acc.unwrap_model(compiled)._orig_mod is model
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is model


def test_free_memory_forgets_every_prepared_object():
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    out = acc.free_memory(*acc.prepare(*parts()))
    assert out == [None, None, None] and not acc.prepared.models and not acc.prepared.optimizers
    model, opt, dl = acc.prepare(*parts())  # a second training in the same process
    train(acc, model, opt, dl)
    assert acc.optimizer_steps > 0 or acc.scaler is not None


@pytest.mark.parametrize("precision,diagnostics", [("no", None), ("bf16", {"gradient_stats_every": 1}),
                                                   ("fp16", {"trace_overflow": True})])
def test_a_dropped_accelerator_and_what_it_prepared_are_freed_at_once_not_by_the_garbage_collector(
        precision, diagnostics):
    """Accelerate's tests/test_data_loader.py (test_ensure_dataloader_gets_cleaned_up) drops an
    object holding an Accelerator, its prepared dataloader and an iterator in mid-epoch, and
    expects all of them gone at once, with no garbage collection: nothing they hold points back at
    the Accelerator (a cycle would keep a GPU's memory taken until the collector next runs). Here
    with a model, an optimizer, a scheduler and steps taken too. The model is left out: its
    patched forward holds the model, as Accelerate's does."""
    import gc
    import weakref

    class Run:
        def __init__(self):
            model, opt, dl = parts()
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            self.acc = Accelerator(mixed_precision=precision, cpu=True, diagnostics=diagnostics)
            self.model, self.opt, self.sched, self.dl = self.acc.prepare(model, opt, sched, dl)
            self.iter = iter(self.dl)
            for _ in range(3):
                x, y = next(self.iter)
                self.acc.backward(torch.nn.functional.mse_loss(self.model(x).float(), y))
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()

    Run()  # once first: what the first step imports may keep a frame (and so the run) until a collection
    gc.collect()
    gc.disable()
    try:
        run = Run()
        refs = {name: weakref.ref(obj) for name, obj in [
            ("accelerator", run.acc), ("optimizer", run.opt), ("scheduler", run.sched), ("dataloader", run.dl),
            ("gradient_state", run.acc.gradient_state), ("steps", run.acc.steps), ("preparer", run.acc.preparer)]}
        del run
        assert [name for name, ref in refs.items() if ref() is not None] == []
    finally:
        gc.enable()


def test_an_accelerator_never_named_still_trains_its_model_in_its_precision():
    """``model, opt = Accelerator(mixed_precision=...).prepare(model, opt)`` keeps no name for the
    Accelerator (it is freed at once): what it prepared still runs in its precision and steps."""
    import gc

    model, opt, dl = parts()
    before = model.weight.detach().clone()
    model, opt = Accelerator(mixed_precision="bf16", cpu=True).prepare(model, opt)
    gc.collect()
    x, y = next(iter(dl))
    out = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, model.__class__.forward(model, x).float())
    torch.nn.functional.mse_loss(out, y).backward()
    opt.step()
    assert not torch.equal(model.weight, before)


def test_seedable_epochs_replay_with_set_epoch_and_data_seed_decides_the_order():
    def order(acc, epochs=2):
        _, _, dl = parts(n=12, batch_size=3)
        dl = acc.prepare(dl)
        got = [x.sum().item() for _ in range(epochs) for x, _ in dl]
        dl.set_epoch(0)
        again = [x.sum().item() for _ in range(epochs) for x, _ in dl]
        return got, again

    got, again = order(Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(data_seed=1)))
    assert got == again
    other, _ = order(Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(data_seed=2)))
    assert other != got


@pytest.mark.parametrize("shape", ["sampler_in_own_batch_sampler", "no_generator_in_batch_sampler", "user_generator"])
def test_seedable_orders_are_accelerates_whatever_generator_or_batch_sampler_the_random_sampler_has(shape):
    """With use_seedable_sampler (transformers' Trainer's default), Accelerate seeds each epoch's
    order with seed + epoch for the RandomSampler it finds, the DataLoader's or the one inside its
    batch sampler, whatever generator it draws from: sentence-transformers' trainer gives a batch
    sampler of its own around a RandomSampler with its own generator. The same batches, epoch for
    epoch and again after set_epoch, and the same global RNG after them."""
    accelerate = pytest.importorskip("accelerate")
    import mixprec

    def loader():
        data, g = list(range(11)), torch.Generator().manual_seed(7)
        if shape == "user_generator":
            return DataLoader(data, batch_size=3, shuffle=True, generator=g)
        sampler = torch.utils.data.RandomSampler(data, generator=None if shape.startswith("no_") else g)
        return DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(sampler, 3, drop_last=False))

    def orders(lib):
        torch.manual_seed(42)
        config = lib.DataLoaderConfiguration(use_seedable_sampler=True)
        dl = lib.Accelerator(cpu=True, dataloader_config=config).prepare(loader())
        epochs = []
        for epoch in (0, 1, 2, 1):
            dl.set_epoch(epoch)
            epochs.append([b.tolist() for b in dl])
        return epochs, torch.rand(1).item()

    try:
        theirs = orders(accelerate)
    finally:
        accelerate.state.AcceleratorState._reset_state(True)
    ours = orders(mixprec)
    assert ours == theirs
    assert ours[0][0] != ours[0][1] and ours[0][3] == ours[0][1]  # epochs differ; set_epoch replays one


@pytest.mark.parametrize("lib", ["torch", "accelerate"])
def test_a_generator_given_to_the_sampler_only_draws_the_order_and_the_base_seed_comes_from_the_global_rng(lib):
    """``DataLoader(sampler=RandomSampler(data, generator=g))``: torch draws the workers' base seed
    from its global RNG (the DataLoader has no generator) and only the order from ``g``. Drawn from
    ``g`` as well, every epoch's order was one draw off torch's and Accelerate's."""
    import mixprec

    def run(prepare):
        torch.manual_seed(0)
        sampler = torch.utils.data.RandomSampler(range(20), generator=torch.Generator().manual_seed(7))
        dl = prepare(DataLoader(list(range(20)), sampler=sampler, batch_size=4))
        epochs = []
        for _ in range(3):
            epochs.append([b.tolist() for b in dl])
            torch.rand(1)  # the model's dropout between epochs
        return epochs, torch.rand(2).tolist()

    if lib == "torch":
        theirs = run(lambda dl: dl)
    else:
        accelerate = pytest.importorskip("accelerate")
        try:
            theirs = run(accelerate.Accelerator(cpu=True).prepare)
        finally:
            accelerate.state.AcceleratorState._reset_state(True)
    assert run(mixprec.Accelerator(cpu=True).prepare) == theirs


@pytest.mark.parametrize("stateful", [False, True])
def test_load_state_resumes_where_accelerate_does_or_at_the_next_batch_when_stateful(tmp_path, stateful):
    """Default (Accelerate's): the epoch that was running starts again at its first batch, in its
    order, and the loop skips what it saw. Stateful: load_state resumes at the next batch."""
    def run(save_after=None, resume=False):
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=stateful))
        model, opt, dl = acc.prepare(*parts())
        seen = []
        if resume:
            acc.load_state(tmp_path / "ck")
        skip = 3 if resume and not stateful else 0
        for i, (x, y) in enumerate(acc.skip_first_batches(dl, skip) if skip else dl):
            seen.append(x.sum().item())
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            if save_after is not None and i + 1 == save_after:
                acc.save_state(tmp_path / "ck")
                return seen, model
        return seen, model

    full, m_full = run()
    first, _ = run(save_after=3)
    rest, m_rest = run(resume=True)
    assert first + rest == full
    torch.testing.assert_close(m_full.weight, m_rest.weight, rtol=0, atol=0)


def test_an_accelerator_with_prepared_dataloaders_pickles():
    acc = Accelerator(cpu=True)
    _, _, dl = parts(n=8, shuffle=False)
    dl = acc.prepare(dl)
    back = pickle.loads(pickle.dumps(acc))
    assert len(back._dataloaders) == 1
    assert [x.sum().item() for x, _ in back._dataloaders[0]] == [x.sum().item() for x, _ in dl]


def test_every_expected_failure_of_the_peer_suites_says_why():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("run_peer", Path(__file__).parent / "peer" / "run_peer.py")
    run_peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_peer)
    listed = run_peer.expected_failures()
    assert listed and all(len(why) > 20 for why in listed.values()), listed
    assert all("::" in test for test in listed)


def test_preemptible_turns_sigterm_into_should_stop_and_restores_the_handler():
    import os
    import signal

    acc = Accelerator(cpu=True)
    before = signal.getsignal(signal.SIGTERM)
    assert acc.should_stop is False  # outside preemptible(): never
    with acc.preemptible():
        assert acc.should_stop is False
        os.kill(os.getpid(), signal.SIGTERM)  # the process is not killed: the flag is set
        assert acc.should_stop is True and acc.should_stop is True
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_assigned_scaler_steps_every_prepared_optimizer_from_then_on():
    """``accelerator.scaler = torch.amp.GradScaler(...)`` (Accelerate's attribute, which
    transformers' own tests assign): taken with its settings and state, it scales the next
    backward and decides the next steps; ``None`` scales nothing; fp32 has no use for one."""
    acc = Accelerator(mixed_precision="fp16", cpu=True)
    model, opt, dl = acc.prepare(*parts())
    train(acc, model, opt, dl)  # steps under the default scaler first: the new one takes over mid-run
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    assert isinstance(acc.scaler, LossScaler) and acc.scaler.get_scale() == 2.0**10
    assert opt.scaler is acc.scaler and acc.scaler.get_growth_interval() == 2
    x, y = next(iter(dl))
    for _ in range(2):  # two clean steps: growth_interval=2 doubles the scale once
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        opt.zero_grad()
    assert acc.scaler.get_scale() == 2.0**11 and not opt.step_was_skipped
    before = acc.unwrap_model(model).weight.detach().clone()
    acc.backward(torch.nn.functional.mse_loss(model(x).float(), y) * float("inf"))
    opt.step()
    opt.zero_grad()
    assert opt.step_was_skipped and acc.scaler.get_scale() == 2.0**10
    assert torch.equal(acc.unwrap_model(model).weight, before)

    acc.scaler = None  # nothing scaled: the gradient is the loss's own
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    acc.backward(loss)
    grad = acc.unwrap_model(model).weight.grad.clone()
    opt.zero_grad()
    reference = torch.autograd.grad(torch.nn.functional.mse_loss(model(x).float(), y),
                                    acc.unwrap_model(model).weight)[0]
    assert acc.scaler is None and torch.allclose(grad, reference)
    assert "loss scaler" in acc.precision_report().line()

    with pytest.raises(ValueError, match="does nothing for fp32"):
        Accelerator(cpu=True).scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TypeError, match="LossScaler or a torch.amp.GradScaler"):
        acc.scaler = 2.0
    acc.native_amp = True  # (transformers' tests set it beside the scaler: fp16 runs under autocast already)
    with pytest.raises(ValueError, match="native_amp follows the precision"):
        Accelerator(cpu=True).native_amp = True

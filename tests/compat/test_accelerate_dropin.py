"""Accelerate's contract beyond its tests (issue 23): kwargs_handlers, what `accelerate launch` sets,
Accelerate's utilities beside mixprec, transparent prepared optimizers, the FSDP1 plugin fields,
and the rest of the Accelerator's public names."""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mixprec
from mixprec import Accelerator, FullyShardedDataParallelPlugin
from mixprec.accelerator.handlers import GradScalerKwargs, ProfileKwargs
from mixprec.accelerator.state import DistributedType, split_for_process

accelerate = pytest.importorskip("accelerate")
from accelerate import utils as au  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")
SRC = Path(__file__).resolve().parents[2] / "src"


# -- kwargs_handlers ---------------------------------------------------------------------------------
def test_accelerates_handlers_reach_the_parts_that_use_them(tmp_path):
    acc = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[
        au.GradScalerKwargs(init_scale=1024.0, growth_interval=10),
        au.DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook=au.DDPCommunicationHookType.BF16),
        au.InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=90)),
        au.ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path / "trace"))])
    assert acc.precision.scaler.get_scale() == 1024.0 and acc.precision.scaler.get_growth_interval() == 10
    assert acc.preparer.ddp_kwargs == {"find_unused_parameters": True} and acc.ddp_comm_hook == "bf16"
    assert acc.init_handler.timeout == datetime.timedelta(seconds=90)
    assert acc.scaler_handler.init_scale == 1024.0 and acc.ddp_handler.find_unused_parameters
    with acc.profile() as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert "aten::mm" in prof.key_averages().table()
    assert (tmp_path / "trace" / "trace_0.json").is_file()


def test_a_scaler_handler_under_a_precision_without_a_scaler_is_ignored_as_in_accelerate():
    acc = Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
    assert acc.precision.scaler is None and acc.scaler_handler.init_scale == 8.0


def test_autocast_handler_turns_autocast_off_inside_the_block():
    acc = Accelerator(cpu=True, mixed_precision="bf16", kwargs_handlers=[au.AutocastKwargs(enabled=False)])
    with acc.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with acc.autocast(autocast_handler=mixprec.accelerator.handlers.AutocastKwargs(enabled=True)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_wrong_or_repeated_or_fp8_handlers_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="You can only pass one GradScalerKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[GradScalerKwargs(), au.GradScalerKwargs()])
    with pytest.raises(ValueError, match="it takes AORecipeKwargs, AutocastKwargs, DistributedDataParallelKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[object()])
    with pytest.raises(NotImplementedError, match="not TransformerEngine or MS-AMP; pass AORecipeKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[type("TERecipeKwargs", (), {})()])
    with pytest.raises(ValueError, match="power_sgd"):
        Accelerator(cpu=True, kwargs_handlers=[
            au.DistributedDataParallelKwargs(comm_hook=au.DDPCommunicationHookType.POWER_SGD)])


def test_profile_kwargs_build_a_scheduled_profiler():
    steps = []
    handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 1}, on_trace_ready=steps.append)
    with Accelerator(cpu=True).profile(handler) as prof:
        for _ in range(4):
            torch.ones(8) + 1
            prof.step()
    assert len(steps) == 1


# -- what `accelerate launch` sets ----------------------------------------------------------------------
def test_the_launchers_environment_applies_where_the_script_passes_no_argument(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    acc = Accelerator()
    assert acc.mixed_precision == "bf16" and acc.device.type == "cpu" and acc.gradient_accumulation_steps == 4
    assert acc.precision_report().precision == "bf16-mixed"
    explicit = Accelerator(mixed_precision="no", gradient_accumulation_steps=2)
    assert explicit.mixed_precision == "no" and explicit.gradient_accumulation_steps == 2


LAUNCHED = """
import json, sys, torch
if sys.argv[1] == "mixprec":
    from mixprec import Accelerator
else:
    from accelerate import Accelerator
acc = Accelerator()
model, opt = acc.prepare(torch.nn.Linear(4, 4), torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1))
with acc.autocast():
    out = torch.randn(2, 4, device=acc.device) @ torch.randn(4, 4, device=acc.device)
print("RESULT " + json.dumps({"n": acc.num_processes, "mixed_precision": acc.mixed_precision,
                              "out": str(out.dtype), "device": acc.device.type,
                              "accumulation": acc.gradient_accumulation_steps}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", [["--cpu", "--mixed_precision", "bf16"], ["--config_file", "CONFIG"]])
def test_accelerate_launch_starts_mixprec_as_it_starts_accelerate(tmp_path, how):
    """`accelerate launch` (Accelerate's own command) with flags or an `accelerate config` file
    (MULTI_CPU, 2 processes asked: on the CPU Accelerate 1.16 starts one, and says bf16)."""
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    config = tmp_path / "config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nmixed_precision: bf16\n"
                      "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: true\n")
    args = [str(config) if a == "CONFIG" else a for a in how]
    seen = {}
    for side in ("accelerate", "mixprec"):
        proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *args, str(script), side],
                              capture_output=True, text=True, timeout=180,
                              env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen[side] = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert seen["mixprec"] == seen["accelerate"]
    assert seen["mixprec"][0]["mixed_precision"] == "bf16" and seen["mixprec"][0]["out"] == "torch.bfloat16"


def test_accelerates_logging_and_utilities_work_beside_mixprecs_accelerator(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "from accelerate.logging import get_logger\nfrom accelerate.utils import gather_object\n"
        "from mixprec import Accelerator\nimport logging\nlogging.basicConfig(level=logging.INFO)\n"
        "acc = Accelerator(cpu=True)\nget_logger('x').info('hello from rank %d', acc.process_index)\n"
        "print('gathered', gather_object(['a']))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hello from rank 0" in proc.stderr and "gathered ['a']" in proc.stdout


# -- prepared objects are transparent ---------------------------------------------------------------
class Remembering(torch.optim.SGD):
    """An optimizer with its own methods and attributes (as schedule-free optimizers have)."""

    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.mode = "train"
        self.custom_attribute = 42

    def train(self):
        self.mode = "train"

    def eval(self):
        self.mode = "eval"


def test_the_prepared_optimizer_passes_its_methods_and_attributes_through():
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    _, opt = acc.prepare(model, Remembering(model.parameters()))
    opt.eval()
    assert opt.optimizer.mode == "eval" and opt.mode == "eval" and opt.custom_attribute == 42
    opt.train()
    assert opt.optimizer.mode == "train"
    with pytest.raises(AttributeError):
        opt.no_such_thing  # noqa: B018



def test_a_prepared_model_returns_fp32_outputs_under_bf16_as_accelerates_does():
    """Accelerate wraps the forward in ``convert_outputs_to_fp32``: a loss computed from the outputs
    outside autocast is fp32's. Other tensors (int, fp32) and the containers pass unchanged."""
    import accelerate

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"logits": y, "pair": (y, x.argmax(-1)), "y32": y.float()}

    from accelerate.state import AcceleratorState

    seen = []
    AcceleratorState._reset_state(reset_partial_state=True)  # what an earlier test's Accelerator left
    try:
        for lib in (accelerate, mixprec):
            torch.manual_seed(0)
            out = lib.Accelerator(cpu=True, mixed_precision="bf16").prepare(Net())(torch.randn(2, 4))
            seen.append({k: [t.dtype for t in v] if isinstance(v, tuple) else v.dtype for k, v in out.items()})
    finally:  # Accelerate's state is process-global: the next test's Accelerator chooses its own precision
        AcceleratorState._reset_state(reset_partial_state=True)
    assert seen[0] == seen[1] == {"logits": torch.float32, "pair": [torch.float32, torch.int64], "y32": torch.float32}

# -- FSDP1 fields -------------------------------------------------------------------------------------------
def test_fsdp1_fields_with_an_fsdp2_meaning_are_taken_and_the_others_explained():
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig

    plugin = FullyShardedDataParallelPlugin(
        state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
        optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
        sharding_strategy="SHARD_GRAD_OP", use_orig_params=True, sync_module_states=True,
        backward_prefetch="BACKWARD_PRE", limit_all_gathers=True, state_dict_type="SHARDED_STATE_DICT")
    assert plugin.reshard_after_forward is False
    assert FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD").reshard_after_forward is True
    for name, value, why in [("sharding_strategy", "HYBRID_SHARD", "HYBRID_SHARD is not offered"),
                             ("cpu_offload", True, "offloading parameters to the CPU"),
                             ("mixed_precision_policy", object(), "Accelerator\\(mixed_precision"),
                             ("ignored_modules", [torch.nn.Linear(1, 1)], "every parameter is sharded"),
                             ("param_init_fn", print, "build the model on every rank"),
                             ("min_num_params", 1000, "size-based wrapping is not offered")]:
        with pytest.raises(ValueError, match=f"{name}=.*has no FSDP2 meaning here: .*{why}"):
            FullyShardedDataParallelPlugin(**{name: value})


# What `accelerate launch --use_fsdp` (or an `accelerate config` with FSDP) puts in the environment.
LAUNCHER_FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
                 "FSDP_OFFLOAD_PARAMS": "false", "FSDP_MIN_NUM_PARAMS": "0",
                 "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block,Other",
                 "FSDP_FORWARD_PREFETCH": "false", "FSDP_USE_ORIG_PARAMS": "true",
                 "FSDP_CPU_RAM_EFFICIENT_LOADING": "false", "FSDP_SYNC_MODULE_STATES": "true",
                 "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}


def test_the_launchers_fsdp_settings_are_read_as_accelerates_plugin_reads_them(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin as Theirs

    for key, value in LAUNCHER_FSDP.items():
        monkeypatch.setenv(key, value)
    theirs, ours = Theirs(), Accelerator(cpu=True).state.fsdp_plugin
    assert isinstance(ours, FullyShardedDataParallelPlugin)
    assert (ours.reshard_after_forward, ours.transformer_cls_names_to_wrap, ours.activation_checkpointing) == \
        (theirs.reshard_after_forward, theirs.transformer_cls_names_to_wrap, theirs.activation_checkpointing)
    assert ours.auto_wrap_policy == "transformer_based_wrap" and theirs.auto_wrap_policy.__name__.startswith("transformer")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
    monkeypatch.delenv("FSDP_RESHARD_AFTER_FORWARD")
    plugin = FullyShardedDataParallelPlugin.from_env(os.environ)
    assert plugin.auto_wrap_policy == "no_wrap" and plugin.reshard_after_forward is True


def test_launcher_fsdp_settings_without_an_fsdp2_meaning_are_refused_saying_why():
    base = {**LAUNCHER_FSDP, "FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}
    with pytest.warns(UserWarning, match="FSDP_VERSION=1.*fsdp_version: 2"):
        assert FullyShardedDataParallelPlugin.from_env(base).reshard_after_forward is False
    for change, why in [({"FSDP_OFFLOAD_PARAMS": "true"}, "offloading parameters to the CPU"),
                        ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000"},
                         "size-based wrapping is not offered"),
                        ({"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"}, "HYBRID_SHARD is not offered"),
                        ({"FSDP_AUTO_WRAP_POLICY": "LAYER_WISE"}, "choose TRANSFORMER_BASED_WRAP or NO_WRAP")]:
        with pytest.warns(UserWarning), pytest.raises(ValueError, match=why):
            FullyShardedDataParallelPlugin.from_env({**base, **change})

# -- the rest of the surface -----------------------------------------------------------------------------------
def test_distributed_type_has_every_one_of_accelerates_members_and_compares_equal():
    from accelerate.utils import DistributedType as Theirs

    assert [m.name for m in DistributedType] == [m.name for m in Theirs]
    assert all(DistributedType[m.name] == m for m in Theirs)


def test_split_between_processes_gives_contiguous_shares_like_accelerate():
    data = list(range(7))
    shares = [split_for_process(data, 3, i) for i in range(3)]
    assert shares == [[0, 1, 2], [3, 4], [5, 6]]
    assert [split_for_process(data, 3, i, apply_padding=True) for i in range(3)] == [[0, 1, 2], [3, 4, 6], [5, 6, 6]]
    t = torch.arange(5)
    assert torch.equal(split_for_process({"x": t}, 2, 1)["x"], torch.tensor([3, 4]))
    acc = Accelerator(cpu=True)
    with acc.split_between_processes(data) as mine:
        assert mine == data  # one process: everything


def test_the_remaining_accelerator_names_answer_as_accelerate_does_without_their_feature(tmp_path):
    acc = Accelerator(cpu=True, mixed_precision="bf16")
    assert acc.deepspeed_plugin is None and acc.state.deepspeed_plugin is None and acc.parallelism_config is None
    assert acc.native_amp and not acc.multi_device and not acc.is_fsdp2 and acc.should_save_model
    assert acc.even_batches and acc.dispatch_batches is None and not acc.non_blocking
    assert torch.equal(acc.pad_across_processes(torch.ones(3)), torch.ones(3))
    with pytest.raises(RuntimeError, match="parallelism_config"):
        acc.data_parallel_rank  # noqa: B018
    acc.save({"w": torch.ones(2)}, tmp_path / "w.safetensors", safe_serialization=True)
    acc.save({"w": torch.ones(2)}, tmp_path / "w.bin")
    assert torch.load(tmp_path / "w.bin", weights_only=True)["w"].sum() == 2
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        Accelerator(cpu=True, deepspeed_plugin=object())
    assert Accelerator(cpu=True, dynamo_backend="eager").preparer.compile == {"backend": "eager"}


# -- the same batches as Accelerate for the same seed ----------------------------------------------------
MODES = ["plain", "seedable", "uneven", "split", "dispatch", "dispatch_split", "iterable"]


@functools.cache
def _orders(lib: str, nproc: int) -> dict[str, list[str]]:
    """Every mode's line from each process, one launch per library and number of processes."""
    from toys import SCRIPTS, torchrun

    script = SCRIPTS / "batch_order.py"
    modes = ",".join(MODES)
    cmd = torchrun(script, lib, modes, nproc=nproc) if nproc > 1 else [sys.executable, str(script), lib, modes]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        if "ORDER " in line:
            line = line[line.index("ORDER "):]
            found.setdefault(json.loads(line.split(" ", 2)[2])["mode"], []).append(line)
    assert all(len(found.get(m, [])) == nproc for m in MODES), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {m: sorted(lines) for m, lines in found.items()}


@pytest.mark.slow
@pytest.mark.xdist_group("batch_orders")  # one worker: _orders' launches made once
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_a_prepared_loader_gives_accelerates_batches_index_for_index(mode, nproc):
    """Shuffled, three epochs, 11 samples in batches of 3 (the last round padded on 2 processes,
    or not with even_batches=False), or of 4 split over the processes; sharded or dispatched from
    process 0; or an IterableDataset (dispatched): every process's batches, what
    gather_for_metrics gives, the length, and torch's RNG after them are Accelerate's for the same
    seed, and the prepared loader is a DataLoader."""
    theirs, ours = _orders("accelerate", nproc)[mode], _orders("mixprec", nproc)[mode]
    assert len(ours) == nproc and ours == theirs, (theirs, ours)
    assert all(json.loads(line.split(" ", 2)[2])["is_dataloader"] for line in ours)


@pytest.mark.slow
def test_local_sgd_averages_every_k_steps_and_at_the_end_as_accelerates_does():
    """Two processes on different data: the weights agree right after steps 2 and 4 and after the
    block, differ in between, and are bit for bit those Accelerate's LocalSGD gives."""
    from toys import SCRIPTS, torchrun

    seen = {}
    for side in ("mixprec", "accelerate"):
        proc = subprocess.run(torchrun(SCRIPTS / "local_sgd_two.py", side, nproc=2), capture_output=True, text=True,
                              timeout=180, env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = sorted(line[line.index("WEIGHTS "):] for line in proc.stdout.splitlines() if "WEIGHTS " in line)
        seen[side] = [json.loads(line.split(" ", 2)[2]) for line in lines]
    assert seen["mixprec"] == seen["accelerate"]
    rank0, rank1 = seen["mixprec"]
    assert [a == b for a, b in zip(rank0, rank1)] == [False, True, False, True, False, True]


def test_local_sgd_in_one_process_does_nothing_and_refuses_bad_steps():
    from mixprec import LocalSGD

    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(2, 1))
    before = model.weight.detach().clone()
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert torch.equal(model.weight, before) and local_sgd.num_steps == 1
    with pytest.raises(ValueError, match="local_sgd_steps must be >= 1"):
        LocalSGD(accelerator=acc, model=model, local_sgd_steps=0)

# -- Accelerate's own example scripts --------------------------------------------------------------------
EXAMPLES = Path(os.environ.get("MIXPREC_PEER_SUITES", Path(__file__).resolve().parents[3] / "shared" / "peer-suites"))
EXAMPLES = EXAMPLES / "suites" / "accelerate_examples" / "run.py"


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLES.is_file(), reason="Accelerate's example scripts (../shared/peer-suites) are not here")
@pytest.mark.parametrize("example", ["nlp_example.py bf16", "tracking.py --with_tracking", "cross_validation.py"])
def test_accelerates_example_scripts_run_with_the_import_changed(example, tmp_path):
    """A few of Accelerate's examples (all 21: `tests/peer/run_peer.py` / the shared runner), run as
    written, offline, with `from accelerate import` swapped to mixprec: each passes, and prints the
    anchor's metrics (the runner compares them with those recorded under Accelerate 1.16)."""
    for module in ("evaluate", "tokenizers", "sklearn"):
        pytest.importorskip(module)
    # tracking.py logs to "all" installed trackers: those that need an account (Comet, ClearML,
    # SwanLab) are switched to their offline modes, and every tracker writes under tmp_path.
    offline = {"COMET_START_ONLINE": "false", "COMET_OFFLINE_DIRECTORY": tmp_path / "comet",
               "COMET_DISABLE_AUTO_LOGGING": "1", "CLEARML_OFFLINE_MODE": "1", "CLEARML_CACHE_DIR": tmp_path / "clearml",
               "SWANLAB_MODE": "offline", "SWANLAB_LOG_DIR": tmp_path / "swanlog", "SWANLAB_ROOT": tmp_path / "swanlab",
               "TRACKIO_DIR": tmp_path / "trackio", "HOME": tmp_path / "home"}
    proc = subprocess.run([sys.executable, str(EXAMPLES), sys.executable, "mixprec", "--only", example,
                           "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(SRC), **{k: str(v) for k, v in offline.items()}})
    summary = [line for line in proc.stdout.splitlines() if line.startswith("mixprec ")]
    assert summary and all(line.startswith("mixprec PASS") for line in summary), proc.stdout[-3000:]


@pytest.mark.slow
def test_trackers_run_on_the_main_process_only_under_two_processes(tmp_path):
    from toys import SCRIPTS, torchrun

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = subprocess.run(torchrun(SCRIPTS / "trackers_two.py", str(tmp_path)), capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = sorted((json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("SEEN ")),
                  key=lambda s: s["rank"])
    assert [s["trackers"] for s in seen] == [["tensorboard"], []]
    runs = [p.parent for p in (tmp_path / "two").rglob("events.out.tfevents.*")]
    losses = []
    for run in runs:
        events = EventAccumulator(str(run))
        events.Reload()
        if "loss" in events.Tags()["scalars"]:
            losses += [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [(1, 1.0)]  # rank 0's value, once


# -- Accelerate's utilities, without Accelerate --------------------------------------------------------
def test_the_utilities_scripts_import_beside_the_accelerator_behave_as_accelerates(caplog):
    from accelerate.utils import find_executable_batch_size as theirs_find
    from accelerate.utils import set_seed as theirs_seed

    from mixprec.accelerator.utils import find_executable_batch_size, gather_object, get_logger, set_seed

    set_seed(7)
    ours = (torch.rand(3), __import__("numpy").random.rand(), __import__("random").random())
    theirs_seed(7)
    assert torch.equal(ours[0], torch.rand(3)) and ours[1] == __import__("numpy").random.rand()
    assert ours[2] == __import__("random").random()
    tried = {"ours": [], "theirs": []}
    for who, decorate in (("ours", find_executable_batch_size), ("theirs", theirs_find)):
        @decorate(starting_batch_size=64)
        def train(batch_size, seen):
            seen.append(batch_size)
            if batch_size > 40:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
            return batch_size
        assert train(tried[who]) == 40
    assert tried["ours"] == tried["theirs"] == [64, 57, 51, 45, 40]
    assert gather_object(["a", "b"]) == ["a", "b"]
    with caplog.at_level(logging.INFO, logger="mixprec.test"):
        get_logger("mixprec.test").info("from the main process")
        get_logger("mixprec.test").info("from every process", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["from the main process", "from every process"]

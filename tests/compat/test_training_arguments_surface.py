"""``mixprec.TrainingArguments`` against a live ``transformers.TrainingArguments``: every public
name, the same refusals and normalisations of ``__post_init__``, the ``set_*`` builders, and the
process helpers (``parallel_mode``, ``main_process_first``, ``should_save``, ...).

Each test builds both from the same keyword arguments and compares outcomes: both raise
``ValueError``, or both hold the same field values. Deliberate differences are named where they
are excluded (``optim``'s default: the README's table).
"""

from __future__ import annotations

import copy
import datetime
import inspect
import json
import subprocess
import sys
import warnings

import pytest

import mixprec

transformers = pytest.importorskip("transformers")
from transformers.debug_utils import DebugOption  # noqa: E402
from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType  # noqa: E402
from transformers.training_args import OptimizerNames, ParallelMode  # noqa: E402

#: The fields whose defaults differ on purpose (the README's table of deliberate differences).
DIFFER_ON_PURPOSE = {"optim"}


@pytest.fixture(autouse=True)
def _forget_accelerates_state():
    """transformers' arguments build Accelerate's process-wide ``PartialState``; leave none behind."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _build(lib, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lib.TrainingArguments(**{"output_dir": "o", "report_to": "none", **copy.deepcopy(kwargs)})


def _both(kwargs):
    return _build(transformers, kwargs), _build(mixprec, kwargs)


def _outcome(lib, kwargs):
    try:
        return _build(lib, kwargs)
    except ValueError as e:
        return e


def _shared_fields(theirs, ours, exclude=DIFFER_ON_PURPOSE):
    mine, hf = ours.to_dict(), theirs.to_dict()
    return {k: mine[k] for k in hf if k not in exclude}, {k: v for k, v in hf.items() if k not in exclude}


# -- (a) the public surface ---------------------------------------------------------------------------

def _public(obj) -> set[str]:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_a_live_instance_has_every_public_name_of_transformers_and_of_the_same_kind():
    theirs, ours = _both(dict(use_cpu=True))
    assert _public(theirs) - _public(ours) == set()
    for name in _public(theirs):
        mine, hf = inspect.getattr_static(ours, name), inspect.getattr_static(theirs, name)
        assert callable(mine) == callable(hf), name  # a method stays a method, a value stays a value


@pytest.mark.parametrize("name", ["set_training", "set_evaluate", "set_testing", "set_save", "set_logging",
                                  "set_push_to_hub", "set_optimizer", "set_lr_scheduler", "set_dataloader",
                                  "main_process_first", "get_warmup_steps"])
def test_methods_take_transformers_parameters_with_its_defaults(name):
    def params(cls):
        return [(p.name, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]

    assert params(mixprec.TrainingArguments) == params(transformers.TrainingArguments)


def test_the_derived_values_are_transformers_on_one_cpu_process():
    theirs, ours = _both(dict(use_cpu=True, ddp_timeout=90))
    assert ours.parallel_mode is theirs.parallel_mode is ParallelMode.NOT_PARALLEL
    assert ours.ddp_timeout_delta == theirs.ddp_timeout_delta == datetime.timedelta(seconds=90)
    for name in ("should_save", "should_log", "place_model_on_device", "deepspeed_plugin", "fsdp_plugin_args",
                 "mixed_precision", "world_size", "process_index", "local_process_index",
                 "is_torch_greater_or_equal_than_2_8"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours).default_optim == ours.optim  # transformers': the optim field's default (which differs)
    state, hf_state = ours.distributed_state, theirs.distributed_state
    for name in ("num_processes", "process_index", "local_process_index", "is_main_process",
                 "is_local_main_process", "device", "distributed_type"):
        assert getattr(state, name) == getattr(hf_state, name), name


def test_parallel_mode_without_transformers_is_mixprecs_enum_with_transformers_values(monkeypatch):
    assert [(m.name, m.value) for m in mixprec.trainer.args.ParallelMode] == [(m.name, m.value) for m in ParallelMode]
    monkeypatch.setitem(sys.modules, "transformers.training_args", None)  # import fails, as if not installed
    assert mixprec.TrainingArguments("o").parallel_mode is mixprec.trainer.args.ParallelMode.NOT_PARALLEL


def test_should_save_and_should_log_follow_the_rank_and_each_node(monkeypatch):
    args = mixprec.TrainingArguments("o")
    for rank, local, on_each_node, expected in [(0, 0, False, True), (1, 1, False, False), (2, 0, False, False),
                                                (2, 0, True, True), (3, 1, True, False)]:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        args.save_on_each_node = args.log_on_each_node = on_each_node
        assert args.should_save is args.should_log is expected, (rank, local, on_each_node)


@pytest.mark.parametrize("warmup_steps", [0, 0.1, 0.25, 0.5, 1, 5, 10])
def test_get_warmup_steps_is_transformers_rule(warmup_steps):
    theirs, ours = _both(dict(warmup_steps=warmup_steps))
    for total in (1, 7, 100, 1001):
        assert ours.get_warmup_steps(total) == theirs.get_warmup_steps(total) == ours.warmup_for(total)


@pytest.mark.parametrize("kwargs, env", [(dict(), None), (dict(fp16=True, use_cpu=True), None),
                                         (dict(bf16=True, use_cpu=True), None), (dict(), "bf16"),
                                         (dict(fp16=True, use_cpu=True), "bf16")])
def test_mixed_precision_is_transformers_and_the_precision_the_trainer_runs(monkeypatch, kwargs, env):
    if env is not None:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", env)  # what accelerate launch --mixed_precision sets
    theirs, ours = _both(kwargs)
    assert ours.mixed_precision == theirs.mixed_precision
    assert ours.resolved_precision == {"no": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}[ours.mixed_precision]


@pytest.mark.parametrize("fsdp, config", [("full_shard", {"transformer_layer_cls_to_wrap": "Block"}),
                                          ("shard_grad_op auto_wrap", {"fsdp_transformer_layer_cls_to_wrap": ["A", "B"],
                                                                       "activation_checkpointing": "true"}),
                                          (True, {"state_dict_type": "SHARDED_STATE_DICT",
                                                  "fsdp_reshard_after_forward": "false"}),
                                          ("", None)])
def test_fsdp_plugin_args_are_transformers(monkeypatch, fsdp, config):
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # transformers sets it; restored after
    theirs, ours = _both(dict(fsdp=fsdp, fsdp_config=config))
    assert ours.fsdp_plugin_args == theirs.fsdp_plugin_args


# -- (b) refusals and normalisations of transformers' __post_init__ ------------------------------------

REFUSED = [
    dict(fp16=True, bf16=True, use_cpu=True),
    dict(fp16_full_eval=True, bf16_full_eval=True, use_cpu=True),
    dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps"),
    dict(load_best_model_at_end=True),  # eval "no", save "steps"
    dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=100, save_steps=250),
    dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=0.25),
    dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=200),
    dict(eval_strategy="steps", eval_steps=0, logging_steps=0),
    dict(logging_steps=0),
    dict(eval_strategy="steps", eval_steps=2.5),
    dict(save_steps=2.5),
    dict(logging_steps=12.5),
    dict(torch_empty_cache_steps=0),
    dict(torch_empty_cache_steps=1.5),
    dict(lr_scheduler_type="greedy"),
    dict(lr_scheduler_type="reduce_lr_on_plateau"),
    dict(warmup_steps=-1),
    dict(dataloader_prefetch_factor=2),
    dict(hub_strategy="bogus"),  # checked without push_to_hub too
    dict(eval_strategy="bogus"),
    dict(save_strategy="bogus"),
    dict(logging_strategy="bogus"),
    dict(lr_scheduler_type="bogus"),
    dict(optim="bogus"),
    dict(debug="bogus"),
]


@pytest.mark.parametrize("kwargs", REFUSED, ids=str)
def test_what_transformers_refuses_mixprec_refuses(kwargs):
    theirs, ours = _outcome(transformers, kwargs), _outcome(mixprec, kwargs)
    assert isinstance(theirs, ValueError), "transformers accepts it: not a refusal to compare"
    assert isinstance(ours, ValueError), f"mixprec accepts what transformers refuses ({theirs})"


NORMALISED = [
    dict(report_to="tensorboard"), dict(report_to="none"), dict(report_to=["none"]), dict(report_to=["tensorboard"]),
    dict(torch_compile_backend="eager"), dict(torch_compile_mode="default"), dict(torch_compile=True),
    dict(eval_strategy=IntervalStrategy.STEPS), dict(logging_strategy=IntervalStrategy.EPOCH),
    dict(save_strategy=SaveStrategy.EPOCH), dict(save_strategy=SaveStrategy.BEST, metric_for_best_model="loss",
                                                 eval_strategy="epoch"),
    dict(lr_scheduler_type=SchedulerType.COSINE), dict(optim=OptimizerNames.SGD), dict(hub_strategy=HubStrategy.END),
    dict(debug=[DebugOption.UNDERFLOW_OVERFLOW]), dict(debug="underflow_overflow"), dict(debug=None),
    dict(eval_strategy="steps"), dict(eval_strategy="steps", eval_steps=0, logging_steps=7),
    dict(eval_strategy="steps", logging_steps=0.2), dict(eval_strategy="epoch"),
    dict(logging_steps=10.0, save_steps=20.0, eval_strategy="steps", eval_steps=5.0),
    dict(logging_strategy="epoch", logging_steps=0), dict(save_strategy="no", save_steps=0), dict(eval_steps=2.5),
    dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch"),
    dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=0.1, save_steps=0.2),
    dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="best"),
    dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch"),
    dict(lr_scheduler_type="greedy", eval_strategy="epoch"),
    dict(metric_for_best_model="accuracy"), dict(metric_for_best_model="eval_loss", greater_is_better=True),
    dict(include_num_input_tokens_seen=True), dict(include_num_input_tokens_seen=False),
    dict(gradient_checkpointing=True), dict(activation_checkpointing=True),
    dict(gradient_checkpointing=True, activation_checkpointing=False),
    dict(gradient_checkpointing_kwargs={"use_reentrant": False}),
    dict(gradient_checkpointing_kwargs='{"use_reentrant": "false"}'),
    dict(output_dir=None), dict(output_dir="~/mixprec-runs"), dict(use_cpu=True), dict(disable_tqdm=None),
    dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": "0.1"}'),
    dict(accelerator_config={"split_batches": True}), dict(torch_empty_cache_steps=3), dict(warmup_steps=0.5),
]


@pytest.mark.parametrize("kwargs", NORMALISED, ids=str)
def test_what_transformers_normalises_mixprec_normalises_the_same_way(kwargs):
    theirs, ours = _both(kwargs)
    mine, hf = _shared_fields(theirs, ours)
    assert {k: v for k, v in mine.items() if v != hf[k]} == {}
    for name in ("eval_strategy", "save_strategy", "logging_strategy", "lr_scheduler_type", "hub_strategy"):
        assert type(getattr(ours, name)) is str  # an enum member is kept as its value (equal to transformers')


def test_report_to_all_is_a_list_of_the_installed_loggers_as_in_transformers():
    theirs, ours = _both(dict(report_to="all"))
    assert isinstance(ours.report_to, list) and set(theirs.report_to) <= set(ours.report_to)
    assert "jsonl" in ours.report_to and ours.reporters == set(ours.report_to)  # mixprec's own logger is one of all


def test_accelerator_config_reads_as_attributes_as_transformers_does():
    theirs, ours = _both(dict(accelerator_config={"split_batches": True}))
    for name in ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking"):
        assert getattr(ours.accelerator_config, name) == getattr(theirs.accelerator_config, name)
    assert ours.accelerator_config["split_batches"] is True and json.loads(ours.to_json_string())


def test_save_strategy_best_without_a_metric_is_refused_with_transformers_words(tmp_path):
    """transformers' Trainer refuses it when built (its arguments take it); mixprec's arguments already."""
    import torch

    kwargs = dict(output_dir=str(tmp_path), save_strategy="best", eval_strategy="epoch", report_to="none",
                  use_cpu=True)
    needed = "`args.metric_for_best_model` must be provided when using 'best' save_strategy"
    with pytest.raises(ValueError, match=needed):
        transformers.Trainer(model=torch.nn.Linear(2, 2), args=transformers.TrainingArguments(**kwargs),
                             eval_dataset=[{"x": 0}])
    with pytest.raises(ValueError, match=needed):
        mixprec.TrainingArguments(**kwargs)


def test_the_old_checkpointing_name_warns_as_transformers_does():
    for lib in (transformers, mixprec):
        with pytest.warns(FutureWarning, match="gradient_checkpointing"):
            lib.TrainingArguments("o", gradient_checkpointing=True, report_to="none")


# -- (c) the set_* builders ------------------------------------------------------------------------------

BUILDERS = [
    ("set_training", dict(learning_rate=1e-3, batch_size=4, weight_decay=0.1, num_epochs=2, max_steps=50,
                          gradient_accumulation_steps=2, seed=7, activation_checkpointing=True)),
    ("set_training", dict(gradient_checkpointing=True)),
    ("set_training", dict()),
    ("set_evaluate", dict(strategy="steps", steps=50, batch_size=4, accumulation_steps=2, delay=3, loss_only=True)),
    ("set_evaluate", dict(strategy=IntervalStrategy.EPOCH)),
    ("set_evaluate", dict()),
    ("set_testing", dict(batch_size=16, loss_only=True)),
    ("set_save", dict(strategy="epoch", steps=100, total_limit=2, on_each_node=True)),
    ("set_save", dict(strategy=SaveStrategy.NO, steps=0)),
    ("set_logging", dict(strategy="steps", steps=10, report_to="tensorboard", level="info", first_step=True,
                         nan_inf_filter=True, on_each_node=True, replica_level="error")),
    ("set_logging", dict()),
    ("set_optimizer", dict(name="sgd", learning_rate=0.1, weight_decay=0.01, beta1=0.8, beta2=0.99, epsilon=1e-6)),
    ("set_optimizer", dict(name=OptimizerNames.ADAFACTOR, args="scale_parameter=False")),
    ("set_lr_scheduler", dict(name="cosine", num_epochs=5, max_steps=100, warmup_steps=0.1)),
    ("set_lr_scheduler", dict(name=SchedulerType.CONSTANT_WITH_WARMUP, warmup_steps=10)),
    ("set_dataloader", dict(train_batch_size=16, eval_batch_size=32, drop_last=True, num_workers=2, pin_memory=False,
                            persistent_workers=True, prefetch_factor=4, multiprocessing_context="spawn",
                            in_order=False, auto_find_batch_size=True, ignore_data_skip=True, sampler_seed=3)),
]


@pytest.mark.parametrize("method, kwargs", BUILDERS, ids=lambda x: x if isinstance(x, str) else str(x))
def test_set_builders_set_transformers_fields_and_return_the_arguments(method, kwargs):
    theirs, ours = _both(dict(use_cpu=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert getattr(theirs, method)(**kwargs) is theirs
        assert getattr(ours, method)(**kwargs) is ours
    exclude = set() if method == "set_optimizer" else DIFFER_ON_PURPOSE
    mine, hf = _shared_fields(theirs, ours, exclude)
    assert {k: v for k, v in mine.items() if v != hf[k]} == {}
    ours.validate()  # what a builder leaves, the Trainer takes


@pytest.mark.parametrize("method, kwargs", [("set_evaluate", dict(strategy="steps", steps=0)),
                                            ("set_save", dict(strategy="steps", steps=0)),
                                            ("set_logging", dict(strategy="steps", steps=0)),
                                            ("set_save", dict(strategy="sometimes")),
                                            ("set_optimizer", dict(name="bogus")),
                                            ("set_lr_scheduler", dict(name="bogus"))])
def test_set_builders_refuse_what_transformers_refuses(method, kwargs):
    theirs, ours = _both(dict())
    for args in (theirs, ours):
        with pytest.raises(ValueError):
            getattr(args, method)(**kwargs)


def test_set_push_to_hub_is_refused_saying_why_and_changes_nothing():
    args = mixprec.TrainingArguments("o")
    before = args.to_dict()
    with pytest.raises(ValueError, match="push_to_hub=True is not supported.*upload_folder"):
        args.set_push_to_hub("me/model", token="secret")
    assert args.to_dict() == before and args.push_to_hub is False


# -- (d) main_process_first ------------------------------------------------------------------------------

def test_main_process_first_runs_its_body_once_in_one_process():
    args = mixprec.TrainingArguments("o")
    ran = []
    for local in (True, False):
        with args.main_process_first(local=local, desc="dataset map"):
            ran.append(local)
    assert ran == [True, False]
    with pytest.raises(KeyError), args.main_process_first():  # an error in the body goes through unchanged
        raise KeyError("x")


TWO_PROCESSES = """
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import transformers, mixprec
out, rank = sys.argv[1], int(os.environ["RANK"])
theirs = transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to="none")  # starts the gloo group
ours = mixprec.TrainingArguments(output_dir=out, use_cpu=True, report_to="none")
marker = os.path.join(out, "first.txt")
with ours.main_process_first(desc="write the marker"):
    if rank == 0:
        time.sleep(1.0)  # the other process waits at the barrier meanwhile
        open(marker, "w").write("rank 0")
    seen = os.path.exists(marker)
names = ("parallel_mode", "should_save", "should_log", "world_size", "process_index", "local_process_index")
state = {n: [getattr(a.distributed_state, n) for a in (theirs, ours)] for n in ("num_processes", "process_index")}
json.dump({"seen": seen, "same_mode": ours.parallel_mode is theirs.parallel_mode, "state": state,
           "values": {n: [str(getattr(a, n)) for a in (theirs, ours)] for n in names}},
          open(os.path.join(out, f"rank{rank}.json"), "w"))
"""


@pytest.mark.slow  # torchrun, two gloo processes
def test_two_processes_get_transformers_values_and_the_main_process_goes_first(tmp_path):
    from toys import torchrun

    script = tmp_path / "two.py"
    script.write_text(TWO_PROCESSES)
    proc = subprocess.run(torchrun(script, str(tmp_path)), capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["seen"] and r["same_mode"], rank  # rank 1 ran its body after rank 0 wrote the marker
        assert all(theirs == ours for theirs, ours in r["values"].values()), r["values"]
        assert all(theirs == ours for theirs, ours in r["state"].values()), r["state"]
        assert r["values"]["parallel_mode"][1] == "ParallelMode.DISTRIBUTED"

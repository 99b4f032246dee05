"""``TrainingArguments`` normalised and validated as transformers' are: the same inputs give the
same fields, or an error under both."""

from __future__ import annotations

import warnings

import pytest

import mixprec

transformers = pytest.importorskip("transformers")

SAME = [dict(output_dir="~/mixprec-runs", use_cpu=True),
        dict(output_dir="o", report_to="none"),
        dict(output_dir="o", report_to=["none"]),
        dict(output_dir="o", use_cpu=True, dataloader_pin_memory=True),
        dict(output_dir="o", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": 0.1}'),
        dict(output_dir="o", optim="adafactor", optim_args="beta1=0.9"),
        dict(output_dir="o", hub_strategy="end", hub_model_id="me/model")]  # without push_to_hub: inert


def _both(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.TrainingArguments(**kwargs), mixprec.TrainingArguments(**kwargs)


@pytest.mark.parametrize("kwargs", SAME)
def test_the_same_inputs_give_transformers_fields(kwargs):
    theirs, ours = _both(kwargs)
    fields = [*kwargs, "dataloader_pin_memory"]  # (the defaults that differ on purpose: the README's table)
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}


@pytest.mark.parametrize("kwargs", [dict(output_dir="o", fp16=True, bf16=True, use_cpu=True),
                                    dict(output_dir="o", dataloader_prefetch_factor=2),
                                    dict(output_dir="o", lr_scheduler_type="reduce_lr_on_plateau"),
                                    dict(output_dir="o", optim="adamw_nonexistent")])
def test_what_transformers_refuses_is_refused(kwargs):
    with pytest.raises(ValueError):
        transformers.TrainingArguments(**kwargs)
    with pytest.raises(ValueError):
        mixprec.TrainingArguments(**kwargs)


def test_ddp_compile_determinism_and_cache_settings_reach_what_runs(tmp_path):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = mixprec.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", ddp_find_unused_parameters=True,
            ddp_bucket_cap_mb=5, ddp_static_graph=False, ddp_timeout=60, torch_compile_mode="reduce-overhead",
            full_determinism=True, torch_empty_cache_steps=1, max_steps=2, disable_tqdm=True, save_strategy="no")
    theirs = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile_mode="reduce-overhead")
    assert (args.torch_compile, args.torch_compile_backend) == (theirs.torch_compile, theirs.torch_compile_backend)
    try:
        trainer = mixprec.Trainer(model=torch.nn.Linear(2, 2), args=args)
        # (static_graph=False is DDP's default: not passed, as Accelerate's handler does)
        assert trainer.accelerator.preparer.ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5}
        assert trainer.accelerator.compile == {"backend": "inductor", "mode": "reduce-overhead"}
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="tf32 is taken on an Ampere GPU")
def test_tf32_without_a_gpu_that_has_it_is_refused_as_by_transformers():
    with pytest.raises(ValueError, match="Ampere"):
        transformers.TrainingArguments(output_dir="o", tf32=True)
    with pytest.raises(ValueError, match="Ampere"):
        mixprec.TrainingArguments(output_dir="o", tf32=True)


@pytest.mark.parametrize("kwargs", [dict(output_dir="o", report_to="none"),
                                    dict(output_dir="o", report_to="none", accelerator_config={"split_batches": True},
                                         debug="underflow_overflow", include_for_metrics=["loss"],
                                         gradient_checkpointing=True, hub_token="secret")])
def test_to_dict_to_json_string_and_to_sanitized_dict_give_transformers_values(kwargs):
    import json

    theirs, ours = _both(kwargs)
    differ_on_purpose = {"optim"}  # (the README's table of deliberate differences)
    for method in ("to_dict", "to_sanitized_dict"):
        mine, hf = getattr(ours, method)(), getattr(theirs, method)()
        assert {k: mine[k] for k in hf if k not in differ_on_purpose} == {
            k: v for k, v in hf.items() if k not in differ_on_purpose}, method
    assert json.loads(ours.to_json_string()) == ours.to_dict() and ours.to_dict()["hub_token"] == "<HUB_TOKEN>"


def test_accelerator_config_debug_and_report_to_are_checked_with_the_valid_choices_named():
    for kwargs, match in [(dict(accelerator_config={"split_batch": True}), "split_batches"),
                          (dict(debug="tpu_metrics_debug"), "TPU"), (dict(debug="nope"), "underflow_overflow"),
                          (dict(report_to="neptune"), "wandb"), (dict(include_for_metrics=["labels"]), "inputs")]:
        with pytest.raises(ValueError, match=match):
            mixprec.TrainingArguments(output_dir="o", **kwargs)


def test_save_on_each_node_is_the_default_on_one_machine_and_refused_across_several(monkeypatch):
    assert mixprec.TrainingArguments(output_dir="o", save_on_each_node=True).save_on_each_node
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="every machine sees"):
        mixprec.TrainingArguments(output_dir="o", save_on_each_node=True)


def test_local_rank_is_taken_where_it_agrees_with_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert mixprec.TrainingArguments(output_dir="o", local_rank=1).local_rank == 1
    with pytest.raises(ValueError, match="torchrun"):
        mixprec.TrainingArguments(output_dir="o", local_rank=0)

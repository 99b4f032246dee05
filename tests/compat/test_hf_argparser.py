"""transformers' ``HfArgumentParser`` parses mixprec's ``TrainingArguments`` as it parses its own:
the scripts users run (``run_clm.py`` and the like) build their arguments this way."""

from __future__ import annotations

import warnings

import pytest

import mixprec

transformers = pytest.importorskip("transformers")

ARGV = ["--output_dir", "o", "--learning_rate", "3e-4", "--eval_strategy", "epoch", "--report_to", "none",
        "--bf16", "--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"num_cycles": 0.5}',
        "--debug", "underflow_overflow", "--include_for_metrics", "loss", "inputs", "--gradient_checkpointing",
        "--accelerator_config", '{"split_batches": "true"}', "--use_cpu", "--per_device_train_batch_size", "4",
        "--max_steps", "10", "--warmup_steps", "0.1", "--save_total_limit", "2", "--load_best_model_at_end",
        "--metric_for_best_model", "eval_loss", "--save_strategy", "epoch", "--seed", "7", "--optim", "adafactor",
        "--weight_decay", "0.01", "--logging_steps", "5", "--remove_unused_columns", "False",
        "--label_names", "labels", "--run_name", "x", "--disable_tqdm", "True", "--fsdp", "full_shard",
        "--fsdp_config", '{"reshard_after_forward": "false"}', "--no_dataloader_pin_memory"]


def test_hf_argument_parser_gives_transformers_fields_from_the_same_command_line():
    parsed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lib in (transformers, mixprec):
            (args,) = transformers.HfArgumentParser(lib.TrainingArguments).parse_args_into_dataclasses(ARGV)
            parsed[lib.__name__] = args.to_dict()
    theirs, ours = parsed["transformers"], parsed["mixprec"]
    # (fsdp: transformers 5 turns the options into fsdp=True and its own fsdp_config keys; mixprec
    # keeps them as given and builds its FSDP2 plugin from them: the Distributed page's table)
    assert {k: ours[k] for k in theirs if ours[k] != theirs[k] and k not in ("fsdp", "fsdp_config")} == {}
    assert ours["accelerator_config"]["split_batches"] is True and ours["lr_scheduler_kwargs"] == {"num_cycles": 0.5}
    assert ours["fsdp"] == "full_shard" and ours["fsdp_config"] == {"reshard_after_forward": False}

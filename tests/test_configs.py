"""mixprec.accelerator.configs: Accelerate's configuration objects, on their own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mixprec.accelerator.configs import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    coerce_config,
)


def test_project_configuration_lists_only_complete_numbered_checkpoints_oldest_first(tmp_path):
    cfg = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    assert cfg.logging_dir == str(tmp_path) and cfg.numbered_checkpoints() == []
    for name in ("checkpoint_10", "checkpoint_2", "checkpoint_3.tmp-1234", "notes"):
        (cfg.checkpoints_dir / name).mkdir(parents=True)
    assert [p.name for p in cfg.numbered_checkpoints()] == ["checkpoint_2", "checkpoint_10"]


def test_project_configuration_says_what_is_missing():
    with pytest.raises(ValueError, match="total_limit must be None or an int >= 1"):
        ProjectConfiguration(total_limit=0)
    with pytest.raises(ValueError, match=r"Accelerator\(project_dir=...\)"):
        ProjectConfiguration(automatic_checkpoint_naming=True).numbered_checkpoints()
    cfg = ProjectConfiguration()
    cfg.set_directories("runs/b")
    assert (cfg.project_dir, cfg.logging_dir) == ("runs/b", "runs/b")


def test_uneven_batches_reach_the_prepared_loaders_and_join_uneven_inputs_overrides_them_for_its_block():
    from torch.utils.data import DataLoader

    from mixprec import Accelerator

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
    dl = acc.prepare(DataLoader(list(range(5)), batch_size=2))
    assert dl.even_batches is False and not acc.even_batches
    with pytest.warns(UserWarning, match="one process"), acc.join_uneven_inputs([], even_batches=True):
        assert dl.even_batches is True and acc.even_batches
    assert dl.even_batches is False and not acc.even_batches


def test_coerce_config_takes_none_a_dict_or_a_look_alike_and_names_unknown_fields():
    assert coerce_config(None, GradientAccumulationPlugin, "plugin") == GradientAccumulationPlugin()
    assert coerce_config({"num_steps": 4}, GradientAccumulationPlugin, "plugin").num_steps == 4
    accelerates = SimpleNamespace(num_steps=2, adjust_scheduler=False, sync_with_dataloader=True, sync_each_batch=False)
    got = coerce_config(accelerates, GradientAccumulationPlugin, "plugin")
    assert (got.num_steps, got.adjust_scheduler) == (2, False)
    with pytest.raises(TypeError, match=r"plugin: unknown field\(s\) \['num_step'\]"):
        coerce_config({"num_step": 4}, GradientAccumulationPlugin, "plugin")
    with pytest.raises(TypeError, match="must be a GradientAccumulationPlugin"):
        coerce_config(3, GradientAccumulationPlugin, "plugin")

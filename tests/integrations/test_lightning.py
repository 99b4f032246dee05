"""MixprecPrecision under Lightning's Trainer and Fabric: its names and options, its errors, skipped
steps (the scheduler held back, the log, the warning), the loss scaler's rules as in the Accelerator
(hysteresis, the collapse guard and its fallback), clipping, bf16-true's compensated optimizer under
Fabric, and the sharded strategies' class."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402 (Lightning's own dependency)
from lightning.fabric import Fabric  # noqa: E402
from lightning_toys import Regression, fit, flat, loader, net, quiet, torch_fp16_recipe  # noqa: E402

from mixprec import LossScaleCollapse, LossScaler  # noqa: E402
from mixprec.lightning import MixprecFSDPPrecision, MixprecPrecision  # noqa: E402
from mixprec.precision import PrecisionConfig  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning"),  # fp16 on this CPU
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning")]  # Lightning's own, with torch 2.13


def test_import_mixprec_does_not_import_lightning():
    code = "import sys, mixprec; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('lightning', 'pytorch_lightning'))))"
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout) == [], out.stderr[-2000:]


@pytest.mark.parametrize(("name", "lightning_name"), [("16-mixed", "16-mixed"), ("fp16", "16-mixed"),
                                                      ("32", "32-true"), ("bf16", "bf16-mixed"),
                                                      ("bf16-true", "bf16-true"), ("auto", "bf16-mixed")])
def test_every_mixprec_name_and_alias_is_taken_and_trainer_precision_reads_lightnings_name(name, lightning_name):
    if name == "auto" and MixprecPrecision("auto", device="cpu").plugin.policy.name != "bf16-mixed":
        pytest.skip("auto picks bf16-mixed only where bf16 is native")
    t, _ = fit(plugins=[MixprecPrecision(name)], max_steps=1)
    assert t.precision == lightning_name


def test_an_unknown_precision_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown precision '64-true'. Valid names: fp32 .*bf16-true.*fp8"):
        MixprecPrecision("64-true")


def test_options_are_mixprecs_own_precision_options(tmp_path):
    with pytest.raises(TypeError, match="takes mixprec's precision options, loss_scaler"):
        MixprecPrecision("fp16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="not both"):
        MixprecPrecision("fp16-mixed", precision_config=PrecisionConfig(), loss_scaler={})
    with pytest.raises(ValueError, match="a loss scaler does nothing for bf16-true"):
        MixprecPrecision("bf16-true", loss_scaler={"init_scale": 8.0})
    plugin = MixprecPrecision("fp16-mixed", loss_scaler={"init_scale": 1024.0, "hysteresis": 2})
    assert plugin.scaler.get_scale() == 1024.0 and plugin.scaler.state_dict()["hysteresis"] == 2
    plugin.scaler = LossScaler("cpu", init_scale=8.0)  # assignable, as Lightning's MixedPrecision.scaler
    assert plugin.scaler.get_scale() == 8.0 and plugin.plugin.steps.scaler is plugin.scaler
    with pytest.raises(TypeError, match="takes a mixprec.LossScaler"):
        plugin.scaler = object()
    doctor = tmp_path / "fp8.json"  # what `mixprec doctor --precision fp8 --write-filter` writes
    doctor.write_text(json.dumps({"fp8_recipe": "rowwise", "fp8_filter": ["net.1"]}))
    plugin = MixprecPrecision("fp8", fp8_filter=str(doctor))
    assert plugin.plugin.config.fp8_filter == ("net.1",) and plugin.plugin.config.fp8_recipe == "rowwise"


@pytest.mark.parametrize("face", ["Trainer", "Fabric"])
def test_a_plugin_beside_precision_gets_lightnings_error_and_a_line_saying_to_keep_one(face):
    make = L.Trainer if face == "Trainer" else Fabric
    with pytest.raises(ValueError) as caught:
        make(accelerator="cpu", precision="bf16-mixed", plugins=[MixprecPrecision("fp16-mixed")])
    first, *rest = str(caught.value).splitlines()
    assert first.startswith("Received both `precision=bf16-mixed` and `plugins=MixprecPrecision('fp16-mixed'")
    assert rest == ["mixprec: MixprecPrecision sets the precision itself: keep plugins=[MixprecPrecision(...)] and "
                    "drop precision=, or drop the plugin to train in Lightning's own precision"]
    with pytest.raises(ValueError, match="Received both") as other:  # Lightning's own plugins: its message only
        make(accelerator="cpu", precision="bf16-mixed", plugins=[L.pytorch.plugins.precision.MixedPrecision(
            "bf16-mixed", "cpu")])
    assert "mixprec" not in str(other.value)


def test_a_skipped_step_holds_the_scheduler_back_reaches_the_log_and_is_warned_about(tmp_path):
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # noqa: E731  (interval "step")
    module = Regression(scheduler=sched)
    plugin = MixprecPrecision("fp16-mixed", loss_scaler={"init_scale": 1024.0})
    logger = L.pytorch.loggers.CSVLogger(tmp_path)
    t = L.Trainer(accelerator="cpu", max_epochs=1, plugins=[plugin], logger=logger, log_every_n_steps=1,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning, match=r"mixprec: 1 optimizer step\(s\) skipped for inf/NaN gradients"):
        t.fit(module, loader(overflow_at=9))  # the second of four batches overflows
    lr = t.lr_scheduler_configs[0].scheduler
    assert isinstance(lr, torch.optim.lr_scheduler.StepLR) and lr.last_epoch == 3  # four batches, three applied
    assert plugin.scaler.skipped_steps == 1 and plugin.step_was_skipped(t.optimizers[0]) is False
    assert torch.equal(module.weights[0], module.weights[1])  # the skipped step changed nothing
    assert t.logged_metrics["loss_scale"] == 512.0 and t.logged_metrics["skipped_steps"] == 1.0
    logged = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    assert logged[0].split(",")[:3] == ["epoch", "loss_scale", "skipped_steps"] and len(logged) == 5
    hparams = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert hparams["precision_in_force"].startswith("precision in force (fp16-mixed, single)")
    assert "autocast float16" in hparams["precision_in_force"] and "as the contract says" in hparams["precision_in_force"]


def test_the_loss_scalers_hysteresis_and_bounds_apply_as_in_the_accelerator():
    plugin = MixprecPrecision("fp16-mixed", loss_scaler={"init_scale": 1024.0, "hysteresis": 2, "min_scale": 256.0})
    fit(plugins=[plugin], data_loader=loader(overflow_at=1))  # one overflow: tolerated, the scale kept
    assert plugin.scaler.get_scale() == 1024.0 and plugin.scaler.skipped_steps == 1
    plugin = MixprecPrecision("fp16-mixed", loss_scaler={"init_scale": 1024.0, "min_scale": 512.0})
    overflows = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.full((12, 8), 1e6), torch.ones(12, 1)),
                                            batch_size=4)
    fit(plugins=[plugin], data_loader=overflows)
    assert plugin.scaler.get_scale() == 512.0 and plugin.scaler.skipped_steps == 3  # floored


def _always_overflows():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.cat([torch.full((8, 8), 1e6), torch.randn(8, 8)]), torch.ones(16, 1)), batch_size=4)


def test_the_collapse_guard_raises_or_falls_back_and_a_checkpoint_remembers_the_fallback(tmp_path):
    with pytest.raises(LossScaleCollapse, match="2 optimizer steps in a row were skipped"):
        fit(plugins=[MixprecPrecision("fp16-mixed", loss_scaler={"max_consecutive_skips": 2})],
            data_loader=_always_overflows())
    plugin = MixprecPrecision("fp16-mixed", loss_scaler={"max_consecutive_skips": 2}, on_loss_scale_collapse="fallback")
    t, module = fit(plugins=[plugin], data_loader=_always_overflows())
    assert t.precision in ("bf16-mixed", "32-true") and plugin.scaler is None
    assert plugin.fallbacks == [{"step": 1, "from": "fp16-mixed", "to": plugin.plugin.policy.name}]
    assert not torch.equal(module.weights[1], module.weights[3])  # the steps after the fallback were applied
    t.save_checkpoint(tmp_path / "c.ckpt")
    resumed = MixprecPrecision("fp16-mixed")
    fit(plugins=[resumed], max_epochs=2, ckpt_path=tmp_path / "c.ckpt")
    assert resumed.precision == t.precision and resumed.scaler is None


def test_clipping_under_fp16_clips_the_true_gradients_as_torchs_recipe_does():
    _, ours = fit(plugins=[MixprecPrecision("fp16-mixed")], gradient_clip_val=0.05)
    model = net()
    expected = torch_fp16_recipe(model, torch.optim.SGD(model.parameters(), lr=0.05), loader(),
                                 torch.amp.GradScaler("cpu"), clip=0.05)
    assert all(torch.equal(a, b) for a, b in zip(ours.weights, expected, strict=True))


def test_accumulated_fp16_batches_step_once_with_the_scale_they_were_made_with():
    _, ours = fit(plugins=[MixprecPrecision("fp16-mixed")], accumulate_grad_batches=2)
    model = net()
    optimizer, scaler = torch.optim.SGD(model.parameters(), lr=0.05), torch.amp.GradScaler("cpu")
    expected, batches = [], list(loader())
    for pair in (batches[:2], batches[2:]):
        for x, y in pair:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / 2
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        expected.append(flat(model))
    assert torch.equal(ours.weights[1], expected[0]) and torch.equal(ours.weights[3], expected[1])


def _fabric_bf16_true(set_up_apart: bool):
    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixprecPrecision("bf16-true")])
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
        if set_up_apart:
            model = fabric.setup_module(model)
            wrapped = fabric.setup_optimizers(optimizer)
        else:
            model, wrapped = fabric.setup(model, optimizer)
        for _ in range(3):
            fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean())
            wrapped.step()
            wrapped.zero_grad()
            scheduler.step()
    return fabric, model, optimizer, wrapped, scheduler


@pytest.mark.parametrize("set_up_apart", [False, True], ids=["with its model", "on its own"])
def test_fabric_bf16_true_makes_the_users_optimizer_compensated_in_place(set_up_apart, recwarn):
    fabric, model, optimizer, wrapped, scheduler = _fabric_bf16_true(set_up_apart)
    assert type(optimizer).__module__ == "mixprec.precision.optim.compensated" and wrapped.optimizer is optimizer
    state = wrapped.state_dict()["state"]
    assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq", "kahan_comp"}
    assert state[0]["exp_avg"].dtype == torch.float32 and model.module[0].weight.dtype == torch.bfloat16
    assert model.module[1].weight.dtype == torch.float32  # normalisation layers stay fp32
    assert scheduler.get_last_lr() == [pytest.approx(1e-3 * 0.9**3)] and optimizer.param_groups[0]["lr"] == \
        pytest.approx(1e-3 * 0.9**3)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]  # the scheduler saw the steps
    assert fabric._precision.precision_report().ok


def test_fabric_with_two_optimizers_set_up_apart_updates_the_scale_once_per_iteration():
    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixprecPrecision("fp16-mixed")])
        g, d = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        g, opt_g = fabric.setup(g, torch.optim.SGD(g.parameters(), lr=0.01))
        d, opt_d = fabric.setup(d, torch.optim.SGD(d.parameters(), lr=0.01))
        fabric.backward(d(g(torch.full((4, 8), 1e4))).float().pow(2).mean())  # overflows
        opt_g.step()
        opt_d.step()
    assert fabric._precision.scaler.get_scale() == 2.0**15  # halved once, as torch's recipe does


def test_the_sharded_strategies_class_is_an_fsdp_precision_for_the_trainer_and_fabric():
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy

    plugin = MixprecFSDPPrecision("bf16-mixed", device="cpu")
    FSDPStrategy(precision_plugin=plugin)
    FabricFSDP(precision=plugin)
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=MixprecPrecision("bf16-mixed"))
    config = plugin.mixed_precision_config
    assert (config.param_dtype, config.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert MixprecFSDPPrecision("fp32").mixed_precision_config.param_dtype is None
    policy = MixprecPrecision("fp16-mixed").sharding_policy()  # for fully_shard under ModelParallelStrategy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)


def test_a_checkpoint_of_lightnings_own_mixed_precision_resumes_its_scale(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    theirs = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3))
    t, _ = fit(plugins=[theirs], data_loader=loader(overflow_at=9))
    t.save_checkpoint(tmp_path / "theirs.ckpt")
    ours = MixprecPrecision("fp16-mixed")
    fit(plugins=[ours], max_epochs=1, ckpt_path=tmp_path / "theirs.ckpt")  # (the epoch is done: nothing trains)
    assert ours.scaler.get_scale() == theirs.scaler.get_scale() < 2.0**20
    assert ours.scaler.state_dict()["_growth_tracker"] == theirs.scaler.state_dict()["_growth_tracker"] > 0


@pytest.mark.parametrize(("precision", "required"), [("fp32", False), ("bf16-true", False), ("bf16-mixed", True),
                                                     ("fp16-mixed", True)])
def test_fabric_asks_for_fabric_backward_where_lightnings_own_plugin_would(precision, required):
    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixprecPrecision(precision)])
        model = fabric.setup_module(torch.nn.Linear(2, 2))
        loss = model(torch.rand(2, 2)).float().sum()
        if required:  # the loss is scaled, or autocast runs: as Lightning's MixedPrecision
            with pytest.raises(RuntimeError, match=r"requires you to call `fabric.backward\(loss\)`"):
                loss.backward()
        else:  # as Lightning's Precision and HalfPrecision
            loss.backward()
        fabric.backward(model(torch.rand(2, 2)).float().sum())


class _TakesKeywords(torch.optim.SGD):
    seen: list = []

    def step(self, closure=None, **kwargs):
        self.seen.append(kwargs)
        return super().step(closure)


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_the_trainers_keyword_arguments_to_optimizer_step_reach_the_optimizer(precision):
    class Passes(Regression):
        def optimizer_step(self, epoch, batch_idx, optimizer, closure, **_):
            optimizer.step(closure, tag=batch_idx)

    _TakesKeywords.seen = []
    options = {"loss_scaler": {"init_scale": 1024.0}} if precision == "fp16-mixed" else {}  # (no skipped step)
    fit(Passes(lambda params: _TakesKeywords(params, lr=0.05)), plugins=[MixprecPrecision(precision, **options)],
        max_steps=2)
    assert _TakesKeywords.seen == [{"tag": 0}, {"tag": 1}]


def test_fabric_init_module_makes_bf16_true_weights_in_bf16_and_keeps_norms_fp32():
    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixprecPrecision("bf16-true")])
        with fabric.init_module():
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        assert model[0].weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
        model = fabric.setup_module(model)
    assert model.module[1].weight.dtype == torch.float32

"""MixprecPrecision against the installed Lightning, step for step. Where Lightning is right (bf16-mixed,
fp32, its checkpoints and their resume) mixprec gives its numbers; where it is wrong (16-mixed on the
CPU trains bf16; two optimizers stepped after one fp16 backward update the scale per optimizer; its
bf16-true loses updates below bf16's resolution; fp8 is refused; Fabric's 16-mixed on the CPU applies
an inf step) mixprec gives torch's own recipe. README.md's table of deliberate differences has a row
for each."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning_toys import ROWS, Regression, fit, flat, loader, loss_of, net, quiet, torch_fp16_recipe  # noqa: E402

from mixprec.lightning import MixprecPrecision  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")  # fp16 on this CPU


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_where_lightning_is_right_the_trainer_gives_its_losses_and_weights_step_for_step(precision):
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.8)  # noqa: E731
    _, theirs = fit(Regression(adamw, sched), precision=precision, max_epochs=2)
    t, ours = fit(Regression(adamw, sched), plugins=[MixprecPrecision(precision)], max_epochs=2)
    assert t.precision == precision
    assert len(ours.losses) == 2 * ROWS // 8
    assert torch.equal(torch.stack(ours.losses), torch.stack(theirs.losses))
    assert all(torch.equal(a, b) for a, b in zip(ours.weights, theirs.weights, strict=True))


def _fabric_run(**how):
    with quiet():
        fabric = Fabric(accelerator="cpu", devices=1, **how)
        model = torch.nn.Sequential(torch.nn.LayerNorm(8), net())  # (Fabric casts inputs: LayerNorm sees bf16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = fabric.setup(model, optimizer)
        losses, weights = [], []
        for x, y in fabric.setup_dataloaders(loader(), move_to_device=True):
            loss = loss_of(model, x, y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            weights.append(flat(model))
    return fabric, losses, weights


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_where_lightning_is_right_fabric_gives_its_losses_and_weights_step_for_step(precision):
    _, their_losses, theirs = _fabric_run(precision=precision)
    _, our_losses, ours = _fabric_run(plugins=[MixprecPrecision(precision)])
    assert torch.equal(torch.stack(our_losses), torch.stack(their_losses))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def _resumed(tmp_path, name, how):
    """Two epochs straight, and one epoch, a checkpoint, then the second epoch resumed from it."""
    straight, _ = fit(Regression(), max_epochs=2, **how())
    first, _ = fit(Regression(), max_epochs=1, **how())
    path = tmp_path / f"{name}.ckpt"
    first.save_checkpoint(path)
    again, _ = fit(Regression(), max_epochs=2, ckpt_path=path, **how())
    return straight, again, torch.load(path, weights_only=False)


def test_a_checkpoint_keeps_lightnings_layout_and_resumes_bit_for_bit_where_lightnings_fp32_does(tmp_path):
    scaler = {"init_scale": 2.0**20, "growth_interval": 3}  # an overflow in the first epoch, growth in the second
    runs = {"lightning fp32": lambda: {"precision": "32-true"},
            "mixprec fp32": lambda: {"plugins": [MixprecPrecision("fp32")]},
            "lightning fp16": lambda: {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler(
                "cpu", init_scale=scaler["init_scale"], growth_interval=scaler["growth_interval"]))]},
            "mixprec fp16": lambda: {"plugins": [MixprecPrecision("fp16-mixed", loss_scaler=scaler)]}}
    done = {name: _resumed(tmp_path, name.replace(" ", "_"), how) for name, how in runs.items()}
    for name, (straight, again, _) in done.items():
        # Lightning's own fp32 resume is bit for bit: so is each of these
        assert torch.equal(flat(straight.lightning_module.net), flat(again.lightning_module.net)), name
    keys = {name: set(ckpt) for name, (_, _, ckpt) in done.items()}
    assert keys["mixprec fp32"] == keys["lightning fp32"]  # no precision entry where there is no state
    assert keys["mixprec fp16"] - keys["lightning fp16"] == {"MixprecPrecision"}
    assert keys["lightning fp16"] - keys["mixprec fp16"] == {"MixedPrecision"}
    ours = done["mixprec fp16"][2]["MixprecPrecision"]
    theirs = done["lightning fp16"][2]["MixedPrecision"]
    assert set(theirs) <= set(ours)  # GradScaler's state, and the loss scaler's own beside it
    assert ours["scale"] != scaler["init_scale"] and ours["_growth_tracker"] > 0
    straight, again = done["mixprec fp16"][:2]
    grown, resumed = straight.precision_plugin.scaler, again.precision_plugin.scaler
    assert (resumed.get_scale(), resumed.state_dict()["_growth_tracker"]) == \
        (grown.get_scale(), grown.state_dict()["_growth_tracker"])
    assert resumed.skipped_steps == grown.skipped_steps > 0


def test_16_mixed_on_the_cpu_is_fp16_as_in_torchs_recipe_where_lightning_trains_bf16():
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        theirs = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert theirs.precision == "bf16-mixed"
    t, ours = fit(plugins=[MixprecPrecision("16-mixed")])
    assert t.precision == "16-mixed"
    report = t.precision_plugin.precision_report()
    assert report.observed["autocast"] == "float16" and report.observed["activations"] == "float16"
    model = net()
    expected = torch_fp16_recipe(model, torch.optim.SGD(model.parameters(), lr=0.05), loader(),
                                 torch.amp.GradScaler("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(ours.weights, expected, strict=True))


class _GAN(L.LightningModule):
    """Two models, two optimizers, one backward per iteration (manual optimization)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = _pair()

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        self.manual_backward(self.d(self.g(batch[0])).float().pow(2).mean())
        opt_g.step()
        opt_d.step()
        opt_g.zero_grad()
        opt_d.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.01)


def _pair():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)


SCALER = {"init_scale": 2.0**13, "growth_interval": 2}


def _gan_batches():
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(1)) * 60
    x[20:24] *= 1e4  # the sixth batch overflows fp16 at any scale
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def test_two_optimizers_after_one_fp16_backward_update_the_scale_as_torchs_recipe_where_lightnings_per_step():
    g, d = _pair()
    opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales = []
    for (x,) in _gan_batches():  # torch's recipe for several optimizers: one update per iteration
        with torch.autocast("cpu", dtype=torch.float16):
            loss = d(g(x)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt_g)
        scaler.step(opt_d)
        scaler.update()
        opt_g.zero_grad()
        opt_d.zero_grad()
        scales.append(scaler.get_scale())
    lightning = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", **SCALER))  # real fp16 on the CPU
    _, theirs = fit(_GAN(), _gan_batches(), plugins=[lightning])
    t, ours = fit(_GAN(), _gan_batches(), plugins=[MixprecPrecision("fp16-mixed", loss_scaler=SCALER)])
    assert len(set(scales)) > 2  # grew and backed off
    assert lightning.scaler.get_scale() != scaler.get_scale()  # Lightning updates it after each optimizer's step
    assert t.precision_plugin.scaler.get_scale() == scaler.get_scale()
    assert torch.equal(flat(ours.g), flat(g)) and torch.equal(flat(ours.d), flat(d))
    assert not torch.equal(flat(theirs.g), flat(g))


class _Near1(Regression):
    """Weights in [1, 2), AdamW at lr 1e-3: each update (at most ~3.2 lr) is below half of bf16's spacing there (2**-8)."""

    def __init__(self):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        torch.nn.init.uniform_(model.weight, 1.0, 2.0)
        super().__init__(lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0), model=model)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0].to(self.net.weight.dtype)).float().pow(2).mean()
        self.losses.append(loss.detach())
        return loss


def test_bf16_true_tracks_fp32_through_updates_below_bf16s_resolution_where_lightnings_weights_stay_still():
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(240, 8)), batch_size=4)
    start = _Near1().net.weight.detach().to(torch.bfloat16).float()
    _, fp32 = fit(_Near1(), batches, precision="32-true")
    _, theirs = fit(_Near1(), batches, precision="bf16-true")
    _, ours = fit(_Near1(), batches, plugins=[MixprecPrecision("bf16-true")])
    reference = fp32.net.weight.detach()
    assert len(theirs.losses) == 60 and (reference - start).abs().min() > 2e-2  # fp32 moved every weight
    assert torch.equal(theirs.net.weight.float(), start)  # Lightning's bf16-true: not one weight moved
    their_error = (theirs.net.weight.float() - reference).abs().mean()
    our_error = (ours.net.weight.float() - reference).abs().mean()
    assert our_error < their_error / 5, (our_error, their_error)


def test_fp8_trains_with_torchaos_float8_layers_where_lightning_refuses_it():
    pytest.importorskip("torchao.float8")
    with pytest.raises(ValueError, match="fp8"):
        L.Trainer(accelerator="cpu", precision="fp8")
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    batches = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 32), torch.randn(8, 32)),
                                          batch_size=4)
    t, ours = fit(Regression(model=model), batches, plugins=[MixprecPrecision("fp8")])
    assert type(ours.net[1]).__name__ == "Float8Linear"  # the first and the last stay bf16: the default filter
    assert [type(m).__name__ for m in (ours.net[0], ours.net[2])] == ["Linear", "Linear"]
    report = t.precision_plugin.precision_report()
    assert report.details["float8_in_forward"] and report.ok, report.line()
    assert all(torch.isfinite(loss) for loss in ours.losses)


def test_fabric_16_mixed_on_the_cpu_skips_an_inf_step_where_lightnings_applies_it_and_the_weights_become_nan():
    def run(**how):
        with quiet():
            fabric = Fabric(accelerator="cpu", devices=1, **how)
            model = net()
            model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for scale in (1.0, 1e30, 1.0):
                fabric.backward(model(torch.ones(2, 8) * scale).float().pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
        return fabric, flat(model)

    _, theirs = run(precision="16-mixed")
    assert not torch.isfinite(theirs).all()
    fabric, ours = run(plugins=[MixprecPrecision("16-mixed")])
    assert torch.isfinite(ours).all()
    assert fabric._precision.scaler.skipped_steps == 1

"""fp8: torchao's float8 training behind ``mixed_precision="fp8"`` (emulated on the CPU, so the
numerics are the GPU recipe's): it trains, the float8 casts happen, the layers are chosen and
reported, checkpoints resume bit for bit and cross to bf16, and bad input says what to do."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec import Accelerator, PrecisionPerformanceWarning, resolve_precision
from mixprec.precision.fp8 import float8_layer_choice

pytest.importorskip("torchao.float8")
pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


def mlp(width: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1))


def regression(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True) * x[:, 4:5]).tanh()


def train_mlp(precision: str, steps: int = 60, cpu: bool = True, **kwargs) -> tuple[list[float], Accelerator, nn.Module]:
    torch.manual_seed(0)
    model = mlp()
    acc = Accelerator(cpu=cpu, mixed_precision=precision, **kwargs)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    x, y = (t.to(acc.device) for t in regression())
    losses = []
    for i in range(steps):
        xb, yb = x[(i * 32) % 256:][:32], y[(i * 32) % 256:][:32]
        loss = (model(xb) - yb).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, acc, model


def test_fp8_trains_an_mlp_about_as_well_as_bf16_and_the_float8_casts_happen():
    fp8, acc, model = train_mlp("fp8")
    bf16, _, _ = train_mlp("bf16-mixed")
    assert type(model[2]).__name__ == "Float8Linear" and type(model[0]) is nn.Linear
    first, last = sum(fp8[:5]) / 5, sum(fp8[-10:]) / 10
    assert last < 0.5 * first
    assert abs(last - sum(bf16[-10:]) / 10) < 0.05 * first  # within a few percent of the start
    report = acc.precision_report()
    assert report.ok, report.violations
    assert report.details["float8_in_forward"] == ["float8_e4m3fn"]
    assert report.details["layers"] == {"0": "bf16: the first Linear layer", "2": "float8 (tensorwise)",
                                        "4": "float8 (tensorwise)",
                                        "6": "bf16: 1x64: not multiples of 16, which the float8 kernels need"}
    assert "2 of 4 Linear layers in float8 (tensorwise, emulated by torchao)" in report.line()
    assert acc.mixed_precision == "fp8" and acc.fp8_enabled and acc.fp8_backend == "AO"


def test_fp8_trains_the_pycode_tiny_gpt_within_a_few_percent_of_bf16():
    from mixprec.tasks import get_task

    def run(precision: str) -> tuple[float, float, Accelerator]:
        torch.manual_seed(0)
        task = get_task("pycode", size="tiny")
        acc = Accelerator(cpu=True, mixed_precision=precision)
        model = task.build_model()
        dl = torch.utils.data.DataLoader(task.train_dataset, batch_size=8, shuffle=True, collate_fn=task.collate_fn,
                                         generator=torch.Generator().manual_seed(0))
        model, opt, dl = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3), dl)
        losses = []
        for _, batch in zip(range(30), dl):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return sum(losses[:3]) / 3, sum(losses[-5:]) / 5, acc

    start, fp8, acc = run("fp8")
    _, bf16, _ = run("bf16-mixed")
    assert fp8 < 0.75 * start and abs(fp8 - bf16) < 0.05 * bf16
    details = acc.precision_report().details
    assert details["float8_in_forward"] == ["float8_e4m3fn"]
    assert sum(v.startswith("float8") for v in details["layers"].values()) == len(details["layers"]) - 2


def test_the_layer_choice_follows_the_default_a_list_or_a_callable_and_names_unknown_layers():
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(48, 30), nn.Linear(30, 64), nn.Linear(64, 16))
    assert float8_layer_choice(net) == {
        "0": "the first Linear layer", "1": None, "2": "30x48: not multiples of 16, which the float8 kernels need",
        "3": "64x30: not multiples of 16, which the float8 kernels need", "4": "the last Linear layer"}
    assert float8_layer_choice(net, ["1"])["0"] is None and float8_layer_choice(net, ["1"])["1"].startswith("kept")
    assert [k for k, v in float8_layer_choice(net, lambda m, name: name == "4").items() if v is None] == ["4"]
    assert [k for k, v in float8_layer_choice(net, lambda m, name: name != "1").items() if v is None] == ["0", "4"]
    with pytest.raises(ValueError, match=r"\['9'\], which are not Linear layers.*\['0', '1', '2', '3', '4'\]"):
        float8_layer_choice(net, ["9"])


def test_an_fp8_checkpoint_resumes_bit_for_bit_and_loads_into_a_bf16_run_and_back(tmp_path):
    def make(precision: str):
        torch.manual_seed(0)
        acc = Accelerator(cpu=True, mixed_precision=precision)
        model = mlp()
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        return acc, model, opt

    x, y = regression()

    def steps(acc, model, opt, start, n):
        for i in range(start, start + n):
            acc.backward((model(x[i * 16:][:16]) - y[i * 16:][:16]).pow(2).mean())
            opt.step()
            opt.zero_grad()

    acc, model, opt = make("fp8")
    steps(acc, model, opt, 0, 3)
    acc.save_state(tmp_path / "ckpt")
    steps(acc, model, opt, 3, 3)
    straight = {k: v.clone() for k, v in model.state_dict().items()}

    acc2, model2, opt2 = make("fp8")
    acc2.load_state(tmp_path / "ckpt")
    steps(acc2, model2, opt2, 3, 3)
    assert all(torch.equal(straight[k], v) for k, v in model2.state_dict().items())

    acc3, model3, opt3 = make("bf16-mixed")  # the same names and shapes: Float8Linear is a Linear
    acc3.load_state(tmp_path / "ckpt")
    steps(acc3, model3, opt3, 3, 1)
    acc3.save_state(tmp_path / "from-bf16")
    acc4, model4, _ = make("fp8")
    acc4.load_state(tmp_path / "from-bf16")
    assert all(torch.equal(model3.state_dict()[k], v) for k, v in model4.state_dict().items())


def test_accelerates_ao_recipe_handler_sets_the_recipe_and_the_filter():
    au = pytest.importorskip("accelerate.utils")
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")
    acc = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[
        au.AORecipeKwargs(config=config, module_filter_func=lambda m, name: name == "2")])
    model = acc.prepare(mlp())
    layers = acc.precision_report().details["layers"]
    assert [k for k, v in layers.items() if v.startswith("float8")] == ["2"]
    assert acc.has_fp8_handler and acc.ao_recipe_handler is not None
    assert model[2].config.cast_config_input.scaling_granularity.value == "axiswise"  # rowwise
    with pytest.raises(NotImplementedError, match="not TransformerEngine or MS-AMP; pass AORecipeKwargs"):
        Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[type("TERecipeKwargs", (), {})()])


def test_fp8_on_a_cpu_warns_that_it_is_emulated_and_auto_never_picks_it():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_precision("fp8", "cpu").float8_linears
    assert any(issubclass(w.category, PrecisionPerformanceWarning) and "torchao emulates them" in str(w.message)
               for w in caught)
    assert resolve_precision("auto", "cpu").name != "fp8"


def test_fp8_without_torchao_is_an_error_that_says_what_to_install(monkeypatch):
    import importlib.util

    from mixprec import hardware

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    hardware._detect.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"'fp8' is not supported on cpu: torchao is not installed \(pip install "
                                             r"torchao, or mixprec\[fp8\]\)"):
            Accelerator(cpu=True, mixed_precision="fp8")
    finally:
        hardware._detect.cache_clear()


def test_bad_fp8_options_are_refused_with_the_valid_ones():
    from mixprec.precision import PrecisionConfig

    with pytest.raises(ValueError, match="'tensorwise', 'rowwise', 'rowwise_with_gw_hp'"):
        PrecisionConfig(fp8_recipe="blockwise")
    with pytest.raises(TypeError, match="list of Linear layer names"):
        PrecisionConfig(fp8_filter=3)
    with pytest.raises(ValueError, match="one Linear layer"):
        Accelerator(cpu=True, mixed_precision="fp8", precision_config=PrecisionConfig(fp8_filter=lambda m, name: True)).prepare(
            nn.Linear(16, 16))


@pytest.mark.gpu
def test_fp8_on_cuda_runs_torchaos_float8_kernels_and_trains_like_bf16():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 kernels need compute capability 8.9+")
    fp8, acc, model = train_mlp("fp8", cpu=False)
    bf16, _, _ = train_mlp("bf16-mixed", cpu=False)
    assert not acc.precision.emulated and not model[2].config.emulate
    report = acc.precision_report()
    assert report.ok and report.details["float8_in_forward"] == ["float8_e4m3fn"], report.line()
    first, last = sum(fp8[:5]) / 5, sum(fp8[-10:]) / 10
    assert last < 0.5 * first and abs(last - sum(bf16[-10:]) / 10) < 0.05 * first


def test_the_trainer_takes_precision_fp8(tmp_path):
    from mixprec import Trainer, TrainingArguments
    from mixprec.tasks import get_task

    task = get_task("pycode", size="tiny")
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=str(tmp_path), precision="fp8", max_steps=4, per_device_train_batch_size=8,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=task.build_model(), args=args, train_dataset=task.train_dataset,
                      data_collator=task.collate_fn)
    trainer.train()
    report = trainer.accelerator.precision_report()
    assert report.ok and report.details["float8_in_forward"] == ["float8_e4m3fn"]
    assert "7 of 9 Linear layers in float8" in report.details["summary"]

"""``mixprec doctor --precision fp8``: its quantisation is torchao's byte for byte, it names the layer
that massive activations make fp8-sensitive and no other, and its filter closes the loss gap."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from mixprec import Accelerator  # noqa: E402
from mixprec.apps.fp8_doctor import Fp8DoctorConfig, run_fp8_doctor  # noqa: E402
from mixprec.precision import PrecisionConfig  # noqa: E402
from mixprec.precision.fp8 import float8_casts, load_fp8_filter, quantise_float8  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")


class MassiveActivations(nn.Module):
    """Five Linear layers; a constant of 3e4 is added to two channels of ``l2``'s input, and
    ``l2``'s weights on those channels are zero and stay zero: in exact arithmetic (and in bf16)
    they change nothing, but they set the scale every float8 cast of that input uses."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.l4 = nn.Linear(64, 1)
        offset = torch.zeros(64)
        offset[:2] = 3e4
        self.register_buffer("offset", offset)
        with torch.no_grad():
            self.l1.weight.mul_(0.2)  # l2's other inputs ~0.1: massive against them, as in LLMs
            self.l2.weight[:, :2] = 0
        mask = torch.ones_like(self.l2.weight)
        mask[:, :2] = 0
        self.l2.weight.register_hook(lambda g: g * mask)

    def forward(self, x, labels):
        h = nn.functional.gelu(self.l1(nn.functional.gelu(self.l0(x))))
        h = nn.functional.gelu(self.l3(nn.functional.gelu(self.l2(h + self.offset))))
        return {"loss": nn.functional.mse_loss(self.l4(h).float().squeeze(-1), labels)}


def regression(n: int = 256) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x[:, :4].sum(1) * x[:, 4])
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_the_doctors_quantisation_is_torchaos_cast_byte_for_byte(recipe):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    torch.manual_seed(0)
    x = (torch.randn(64, 48) * torch.logspace(-6, 4, 48)).to(torch.bfloat16)  # spans both formats' ranges
    w, g = torch.randn(32, 48), torch.randn(64, 32) * 1e-6
    config = Float8LinearConfig.from_recipe_name(recipe)
    casts = float8_casts(config)
    for role, t, cast, axis, gemm in [("input", x, config.cast_config_input, -1, GemmInputRole.INPUT),
                                      ("weight", w.t(), config.cast_config_weight, 0, GemmInputRole.WEIGHT),
                                      ("grad_output", g, config.cast_config_grad_output, -1, GemmInputRole.GRAD_OUTPUT),
                                      ("weight_for_grad_input", w.t(), config.cast_config_weight_for_grad_input, -1,
                                       GemmInputRole.WEIGHT)]:
        theirs = hp_tensor_to_float8_dynamic(
            t, cast.target_dtype, LinearMMConfig(), gemm_input_role=gemm, scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        bits, scale = quantise_float8(t, **casts[role])
        assert bits.dtype == theirs._data.dtype, role
        assert torch.equal(bits.view(torch.uint8), theirs._data.view(torch.uint8)), role
        assert torch.equal(scale, theirs._scale), role


def test_the_doctor_names_the_massive_activation_layer_alone_and_its_filter_closes_the_loss_gap(tmp_path):
    config = Fp8DoctorConfig(steps=25, batch_size=16, learning_rate=3e-3)
    report = run_fp8_doctor(MassiveActivations, regression(), tmp_path / "doctor", config=config,
                            task_name="massive", write_filter=tmp_path / "fp8.json")
    rec, layers = report["recommendation"], report["layers"]
    errors = {n: layers[n]["tensorwise"]["output_error"] for n in ("l1", "l2", "l3")}
    assert errors["l2"] > 10 * max(errors["l1"], errors["l3"]), errors  # an order of magnitude worse
    assert set(rec["keep_in_bf16"]) == {"l0", "l2", "l4"} and rec["converted"] == ["l1", "l3"]
    assert "output error" in rec["keep_in_bf16"]["l2"] and rec["keep_in_bf16"]["l0"] == "the first Linear layer"
    assert layers["l2"]["tensorwise"]["input"]["amax"] > 2.9e4 > 100 * layers["l3"]["tensorwise"]["input"]["amax"]
    default, measured = report["probes"][2:]  # torchao's default filter, then the measured one: both verified
    assert default["keep_in_bf16"] == ["l0", "l4"] and measured["keep_in_bf16"] == ["l0", "l2", "l4"]
    assert abs(measured["gap"]) < abs(default["gap"]) and measured["within"], report["probes"]
    # The files a person reads, and the filter the fp8 precision takes.
    for name in ("report.md", "report.json", "fp8_layer_errors.png", "fp8_input_histogram.png"):
        assert (tmp_path / "doctor" / name).stat().st_size > 0
    assert "## Verdict: fp8 (tensorwise)" in (tmp_path / "doctor" / "report.md").read_text()
    fields = load_fp8_filter(tmp_path / "fp8.json")
    assert fields["fp8_filter"] == ("l0", "l2", "l4")
    acc = Accelerator(cpu=True, mixed_precision="fp8", precision_config=PrecisionConfig(**fields))
    acc.prepare(MassiveActivations())
    assert [n for n, v in acc.precision_report().details["layers"].items() if v.startswith("float8")] == ["l1", "l3"]


def test_a_file_that_is_not_a_filter_is_refused_saying_what_it_must_hold(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"keep": ["a"]}))
    with pytest.raises(ValueError, match="a JSON object with 'fp8_filter'"):
        load_fp8_filter(tmp_path / "x.json")

"""The fp8 doctor proves its recommendation (issue 36): it verifies the recommended filter with a loss
probe, searches when it misses, refuses fp8 when nothing passes, and shows every probe.

Four models of our own, each learning the same teacher: one with sink-like channels, one whose
last converted layer's output gradient underflows in e5m2, one fp8 trains well, and one no filter
rescues; the doctor must make the right call on each, and its written filter, applied through
``PrecisionConfig`` as a user applies it, must reproduce the loss it reported.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from mixprec import Accelerator  # noqa: E402
from mixprec.apps.fp8_doctor import Fp8DoctorConfig, run_fp8_doctor, write_fp8_filter  # noqa: E402
from mixprec.apps.fp8_report import summary_lines  # noqa: E402
from mixprec.apps.fp8_search import (  # noqa: E402
    NORMAL_BINADES,
    TOLERANCE_CAP,
    TOLERANCE_FLOOR,
    loss_tolerance,
    rank_float8_layers,
    verify_float8,
)
from mixprec.precision import PrecisionConfig  # noqa: E402
from mixprec.precision.fp8 import load_fp8_filter  # noqa: E402
from mixprec.trainer.datasets import collate  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::mixprec.PrecisionPerformanceWarning")
F = nn.functional
CONFIG = Fp8DoctorConfig(steps=30, batch_size=16, learning_rate=3e-3)


def teacher(n: int = 320) -> list[dict[str, torch.Tensor]]:
    """16 inputs to 16 outputs of a random tanh teacher: what every model below learns."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(16, 16, generator=g) / 4
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(2 * x @ t)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def _frozen(weight: torch.Tensor, where: torch.Tensor) -> None:
    """Zero ``weight``'s gradient where ``where`` is true: those weights keep their values."""
    mask = (~where).float()
    weight.register_hook(lambda g: g * mask)


class Plain(nn.Module):
    """Four Linear layers with GELU: nothing in it that fp8 cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16)])

    def forward(self, x, labels):
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return {"loss": F.mse_loss(self.layers[-1](x).float(), labels)}


class SinkChannels(nn.Module):
    """The issue's model: four Linear layers, and ``l2`` fed by two channels of 1e5 (massive activations,
    as attention sinks make) whose weights are zero and stay zero. They change nothing in bf16, but set
    the scale of every float8 cast of ``l2``'s input, so its other values flush to zero. With two
    layers converted, "4x the median output error" cannot fire: the median of two is their mean."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        offset = torch.zeros(64)
        offset[:2] = 1e5
        self.register_buffer("offset", offset)
        sink = torch.zeros_like(self.l2.weight, dtype=torch.bool)
        sink[:, :2] = True
        with torch.no_grad():
            self.l2.weight[sink] = 0
        _frozen(self.l2.weight, sink)

    def forward(self, x, labels):
        h = F.gelu(self.l1(F.gelu(self.l0(x))))
        h = F.gelu(self.l2(h + self.offset))
        return {"loss": F.mse_loss(self.l3(h).float(), labels)}


class GradientUnderflow(nn.Module):
    """The last layer fp8 converts (``l2``: the output layer ``l3`` stays bf16 by torchao's default) gets
    an output gradient whose range e5m2 cannot hold: two of its output channels are dead (zero weights,
    no bias) and the output layer weighs them 1e10, so their gradient is ~1e10 times the others' and
    sets the scale; the rest flushes to zero, and nothing below ``l2`` learns."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(16, 64), nn.Linear(64, 64)
        self.l2, self.l3 = nn.Linear(64, 64, bias=False), nn.Linear(64, 16)
        dead = torch.zeros_like(self.l2.weight, dtype=torch.bool)
        dead[:2] = True
        loud = torch.zeros_like(self.l3.weight, dtype=torch.bool)
        loud[:, :2] = True
        with torch.no_grad():
            self.l2.weight[dead] = 0
            self.l3.weight[loud] = 1e10
        _frozen(self.l2.weight, dead)
        _frozen(self.l3.weight, loud)

    def forward(self, x, labels):
        h = F.gelu(self.l2(F.gelu(self.l1(F.gelu(self.l0(x))))))
        return {"loss": F.mse_loss(self.l3(h).float(), labels)}


class SinksEverywhere(nn.Module):
    """Five Linear layers; each of the three between the first and the last is fed by two channels of
    1e5 with zero weights: keeping any two of them in bf16 still leaves one whose input flushes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), *(nn.Linear(64, 64) for _ in range(3)), nn.Linear(64, 16)])
        offset = torch.zeros(64)
        offset[:2] = 1e5
        self.register_buffer("offset", offset)
        for layer in self.layers[1:-1]:
            sink = torch.zeros_like(layer.weight, dtype=torch.bool)
            sink[:, :2] = True
            with torch.no_grad():
                layer.weight[sink] = 0
            _frozen(layer.weight, sink)

    def forward(self, x, labels):
        x = F.gelu(self.layers[0](x))
        for layer in self.layers[1:-1]:
            x = F.gelu(layer(x + self.offset))
        return {"loss": F.mse_loss(self.layers[-1](x).float(), labels)}


MODELS = {"plain": Plain, "sink": SinkChannels, "gradient": GradientUnderflow, "everywhere": SinksEverywhere}


@pytest.fixture(scope="module")
def doctor(tmp_path_factory):
    """Each model's doctor report (run once per module), its folder and its filter file."""
    root, data, reports = tmp_path_factory.mktemp("fp8-search"), teacher(), {}

    def get(name: str) -> tuple[dict, object]:
        if name not in reports:
            out = root / name
            reports[name] = (run_fp8_doctor(MODELS[name], data, out, config=CONFIG, task_name=name,
                                            write_filter=root / f"{name}.json"), out)
        return reports[name]

    return get


def test_the_sink_model_reproduces_the_issue_the_first_rule_keeps_first_and_last_and_misses(doctor):
    report, _ = doctor("sink")
    rec = report["recommendation"]
    assert set(rec["measured_rule"]) == {"l0", "l3"}  # the 4x-median rule cannot fire on two layers
    default = report["probes"][2]
    assert default["keep_in_bf16"] == ["l0", "l3"] and not default["within"]
    assert default["gap"] > 3 * report["tolerance"]["value"], default  # far above bf16, as in the issue
    assert report["layers"]["l2"]["tensorwise"]["input"]["flushed"] > 0.5


def test_the_search_keeps_the_sink_fed_layer_for_its_flushed_input_and_meets_the_tolerance(doctor):
    report, _ = doctor("sink")
    rec = report["recommendation"]
    assert rec["fp8"] and set(rec["keep_in_bf16"]) == {"l0", "l2", "l3"} and rec["converted"] == ["l1"]
    assert report["ranking"][0]["layer"] == "l2" and report["ranking"][0]["signal"] == "input flushed"
    assert "input flushes to zero" in rec["keep_in_bf16"]["l2"]
    last = report["probes"][-1]
    assert last["label"].startswith("search 1") and last["within"] and last["keep_in_bf16"] == ["l0", "l2", "l3"]
    assert last["gap"] <= report["tolerance"]["value"]


def test_a_layer_whose_output_gradient_underflows_in_e5m2_is_kept_by_the_search(doctor):
    report, _ = doctor("gradient")
    rec, l2 = report["recommendation"], report["layers"]["l2"]["tensorwise"]
    assert l2["grad_output"]["flushed"] > 0.9 and l2["grad_output"]["format"] == "e5m2"
    assert l2["output_error"] < 2 * report["layers"]["l1"]["tensorwise"]["output_error"]  # its forward is fine
    assert not report["probes"][2]["within"]
    assert rec["fp8"] and set(rec["keep_in_bf16"]) == {"l0", "l2", "l3"}
    assert report["ranking"][0]["signal"] == "output gradient flushed"
    assert "output gradient flushes to zero in e5m2" in rec["keep_in_bf16"]["l2"]


def test_a_model_fp8_trains_well_gets_torchaos_default_filter_verified_without_a_search(doctor):
    report, _ = doctor("plain")
    rec = report["recommendation"]
    assert rec["fp8"] and set(rec["keep_in_bf16"]) == {"layers.0", "layers.3"}
    assert [p["label"].split(",")[0] for p in report["probes"]] == ["bf16-mixed", "bf16-mixed", "fp8"]
    assert report["probes"][-1]["within"] and "within the tolerance" in rec["reason"]
    assert report["seconds"]["search"] == 0


def test_a_model_no_filter_rescues_is_refused_naming_its_layers_and_the_signal(doctor):
    report, out = doctor("everywhere")
    rec = report["recommendation"]
    assert rec["fp8"] is False and rec["converted"] == []
    searched = [p for p in report["probes"] if p["label"].startswith("search")]
    assert len(searched) == 2 and not any(p["within"] for p in report["probes"][2:])  # all but one kept: missed
    for name in ("layers.1", "layers.2", "layers.3"):
        assert f"`{name}`: input flushed" in rec["reason"]
    assert "would leave nothing in float8" in rec["reason"] and "Train this model in bf16-mixed" in rec["reason"]
    assert report["filter"] is None and not (out.parent / "everywhere.json").exists()
    assert "## Verdict: not fp8" in (out / "report.md").read_text()
    with pytest.raises(ValueError, match="recommends against fp8"):
        write_fp8_filter(rec, out / "x.json")


def _user_run(precision: str, build, fields: dict, steps: int, seed: int) -> float:
    """What a user runs: the Accelerator with the precision (and filter file's fields), seed, AdamW, steps."""
    acc = Accelerator(cpu=True, mixed_precision=precision, precision_config=PrecisionConfig(**fields))
    torch.manual_seed(seed)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG.learning_rate)
    dl = torch.utils.data.DataLoader(teacher(), batch_size=CONFIG.batch_size, shuffle=False, collate_fn=collate)
    model, opt, dl = acc.prepare(model, opt, dl)
    losses: list[float] = []
    while len(losses) < steps:  # epochs over the data, as the doctor's probes run
        for batch in dl:
            if len(losses) == steps:
                break
            loss = model(**batch)["loss"]
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return statistics.fmean(losses[-3:])


def test_the_written_filter_through_precision_config_reproduces_the_loss_the_doctor_reported(doctor, tmp_path):
    report, out = doctor("sink")
    fields = load_fp8_filter(report["filter"])
    assert fields == {"fp8_recipe": "tensorwise", "fp8_filter": ("l0", "l2", "l3")}
    reported = report["probes"][-1]["loss"]
    assert _user_run("fp8", SinkChannels, fields, CONFIG.steps, CONFIG.seed) == pytest.approx(reported, rel=1e-6)
    # The measuring run stands for bf16-mixed: its loss is a plain bf16-mixed run's.
    bf16 = _user_run("bf16-mixed", SinkChannels, {}, CONFIG.steps, CONFIG.seed)
    assert bf16 == pytest.approx(report["loss"]["bf16-mixed"], rel=1e-6)


def test_every_probe_is_in_the_json_the_markdown_and_the_printed_lines(doctor):
    report, out = doctor("sink")
    saved, md, printed = json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), summary_lines(report)
    assert len(saved["probes"]) == len(report["probes"]) == 4
    for p in report["probes"]:
        assert p["label"] in md and p["label"] in "\n".join(printed)
        assert f"{p['loss']:.4f}" in md
    for p in report["probes"][1:]:
        assert f"{p['gap']:+.2%}" in md
    assert "| 4 | search 1: + l2 | l0, l2, l3 |" in md and "at most 4 fp8 probes" in md
    assert f"{report['tolerance']['value']:.2%}" in printed[0]


def test_the_tolerance_is_two_bf16_seeds_gap_held_between_the_floor_and_the_cap():
    assert loss_tolerance(2.0, 2.06)["value"] == pytest.approx(0.03)
    low, high = loss_tolerance(2.0, 2.001), loss_tolerance(2.0, 2.4)
    assert low["value"] == TOLERANCE_FLOOR and "below the floor" in low["rule"]
    assert high["value"] == TOLERANCE_CAP and "above the cap" in high["rule"] and high["seed_gap"] == pytest.approx(0.2)
    assert loss_tolerance(2.0, 2.2, override=0.005)["value"] == 0.005
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        Fp8DoctorConfig(tolerance=-0.1)


def _layers(**flushed: float) -> dict:
    """Synthetic probe layers: ``first`` and ``last`` kept by default, the rest with these input flush fractions."""
    def row(default, f):
        stats = {"amax": 1.0, "saturated": 0.0, "flushed": f, "range": 2.0, "format": "e4m3"}
        return {"default": default, "tensorwise": {"input": stats, "output_error": 0.03, "grad_input_error": 0.03}}
    return {"first": row("the first Linear layer", 0.0), **{n: row(None, f) for n, f in flushed.items()},
            "last": row("the last Linear layer", 0.0)}


def test_the_search_keeps_the_worst_first_stops_at_its_budget_and_prunes_what_the_pass_did_not_need():
    layers = _layers(a=0.5, b=0.2, c=0.0, d=0.0)
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "", "last": ""}}
    tried = []

    def loss(keep):  # only keeping b brings fp8 within tolerance
        tried.append(keep)
        return 1.0 if "b" in keep else 1.5

    got = verify_float8(layers, rec, loss, bf16_loss=1.0, tolerance=0.02)
    assert [sorted(set(k) - {"first", "last"}) for k in tried] == [[], ["a"], ["a", "b"], ["b"]]
    assert got["fp8"] and set(got["keep_in_bf16"]) == {"first", "last", "b"}  # a was pruned
    assert [p["label"] for p in got["probes"]][1:] == ["search 1: + a", "search 2: + b", "prune 3: - a"]
    tried.clear()
    refused = verify_float8(layers, rec, lambda keep: tried.append(keep) or 1.5, bf16_loss=1.0, tolerance=0.02,
                            max_probes=2)
    assert not refused["fp8"] and len(tried) == 3  # the default, then 2 search probes: the budget
    assert "`a`: input flushed" in refused["reason"] and "`b`: input flushed" in refused["reason"]


def test_the_cli_prints_every_probe_the_verdict_and_writes_no_filter_when_it_refuses(tmp_path, monkeypatch, capsys):
    from mixprec.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    common = ["doctor", "--precision", "fp8", "--data", f"{Path(__file__).stem}:teacher", "--steps", "30",
              "--batch-size", "16", "--learning-rate", "3e-3", "--cpu"]
    assert main([*common, "--model", f"{Path(__file__).stem}:SinkChannels", "--out", str(tmp_path / "sink"),
                 "--write-filter", str(tmp_path / "sink.json"), "--max-probes", "1"]) == 0
    printed = capsys.readouterr().out
    for line in ("MISSES", "search 1: + l2 [bf16: l0, l2, l3]", "within",
                 "verdict: fp8 (tensorwise), 1 Linear layer in float8, 3 kept in bf16",
                 "l2: kept by the search: ", "at most 1 fp8 probes", f"filter: {tmp_path / 'sink.json'}"):
        assert line in printed, line
    assert main([*common, "--model", f"{Path(__file__).stem}:SinksEverywhere", "--out", str(tmp_path / "all"),
                 "--write-filter", str(tmp_path / "all.json")]) == 0
    printed = capsys.readouterr().out
    assert "verdict: not fp8: train this model in bf16-mixed" in printed and "filter: none written" in printed
    assert not (tmp_path / "all.json").exists()
    assert main([*common, "--model", f"{Path(__file__).stem}:Plain", "--max-probes", "-1"]) == 2
    assert "max_probes must be an int >= 0" in capsys.readouterr().err


def test_when_the_measured_rule_misses_and_the_default_passes_the_verified_default_is_recommended():
    layers = _layers(a=0.5, b=0.0)
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "", "last": "", "a": "its output error is 9x"}}
    got = verify_float8(layers, rec, lambda keep: 1.5 if "a" in keep else 1.0, bf16_loss=1.0, tolerance=0.02)
    assert got["fp8"] and set(got["keep_in_bf16"]) == {"first", "last"} and len(got["probes"]) == 2
    assert "the measured rule's filter ended +50.00%, so torchao's default is kept" in got["reason"]


def test_a_probe_between_one_and_two_tolerances_above_bf16_misses_and_one_at_the_tolerance_passes():
    """The verdict's bound is the tolerance itself: a filter ending 1.5x the tolerance above bf16-mixed
    misses (a looser bound, even 2x, would let it pass), one ending exactly at it passes."""
    layers = _layers(a=0.5)
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "", "last": ""}}
    # (0.25 and 1.375 are exact binary fractions: the gaps are exactly 1x and 1.5x the tolerance)
    refused = verify_float8(layers, rec, lambda keep: 1.375, bf16_loss=1.0, tolerance=0.25)
    assert [p["gap"] for p in refused["probes"]] == [0.375] and not refused["probes"][0]["within"]
    assert not refused["fp8"] and "no filter came within 25.00%" in refused["reason"]
    passed = verify_float8(layers, rec, lambda keep: 1.25, bf16_loss=1.0, tolerance=0.25)
    assert passed["fp8"] and passed["probes"][0]["within"] and passed["probes"][0]["gap"] == 0.25


def test_the_normal_binades_are_those_of_torchs_float8_formats():
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        f = torch.finfo(dtype)
        assert NORMAL_BINADES[name] == pytest.approx(math.log2(f.max / f.smallest_normal), abs=1e-12)


def test_the_tolerance_at_its_bounds_and_without_a_bf16_loss():
    # (0.25 and 2.5 / 2.0 are exact binary fractions: the gap is exactly the floor, then the cap)
    at_floor, at_cap = loss_tolerance(2.0, 2.5, floor=0.25, cap=0.5), loss_tolerance(2.0, 2.5, floor=0.125, cap=0.25)
    assert at_floor["value"] == at_cap["value"] == 0.25
    assert at_floor["rule"] == at_cap["rule"] == "two bf16-mixed seeds' losses differ by 25.00%"
    assert loss_tolerance(0.0, 0.1)["seed_gap"] == 0.0 and loss_tolerance(0.0, 0.1)["value"] == TOLERANCE_FLOOR
    assert loss_tolerance(2.0, 2.2, override=0.005)["rule"] == "set by the user"


def _stats(flushed: float = 0.0, saturated: float = 0.0, range_: float | None = None, fmt: str = "e4m3") -> dict:
    return {"amax": 1.0, "flushed": flushed, "saturated": saturated, "range": range_, "format": fmt}


def test_each_signal_is_scored_against_its_own_limit_and_ties_go_to_the_larger_sum():
    e4m3 = NORMAL_BINADES["e4m3"]
    rows = {
        "quiet": {},  # nothing measured: not ranked, and the others still are
        "w": {"weight": _stats(saturated=0.02), "output_error": 0.1, "grad_input_error": 0.1},
        "r": {"input": _stats(range_=3 * e4m3)},  # no error measured for it
        "o": {"output_error": 1.6, "grad_input_error": 0.1},
        "g": {"grad_output": _stats(flushed=0.005, fmt="e5m2"), "output_error": 0.1, "grad_input_error": 0.8},
    }
    layers = {n: {"default": None, "tensorwise": row} for n, row in rows.items()}
    ranked = rank_float8_layers(layers, list(layers), "tensorwise")  # error_ratio 4: errors suspect at 4x the median (0.1)
    assert [r["layer"] for r in ranked] == ["o", "r", "g", "w"]  # g and w tie at 2: g's sum is the larger
    by = {r["layer"]: r for r in ranked}
    assert by["o"]["severities"] == pytest.approx({"output error": 4.0, "input-gradient error": 0.25})
    assert by["r"]["severities"] == pytest.approx({"input flushed": 0, "input saturated": 0, "input range": 3.0})
    assert by["g"]["severities"] == pytest.approx({"output gradient flushed": 0.5, "output gradient saturated": 0,
                                                   "output error": 0.25, "input-gradient error": 2.0})
    assert by["w"]["severities"] == pytest.approx({"weight flushed": 0, "weight saturated": 2.0, "output error": 0.25,
                                                   "input-gradient error": 0.25})
    assert (by["w"]["signal"], by["w"]["value"], by["w"]["why"]) == (
        "weight saturated", 0.02, "2.0% of its weight saturates in e4m3")
    assert by["r"]["why"].startswith(f"its input spans {3 * e4m3:.1f} binades from its median magnitude")
    zero = {"a": {"default": None, "tensorwise": {"input": _stats(flushed=0.02), "output_error": 0.0}}}
    assert rank_float8_layers(zero, ["a"], "tensorwise")[0]["severities"] == {"input flushed": 2.0, "input saturated": 0}


def _filters(layers, rec, passes, **kwargs):
    """verify_float8 with a probe that passes (loss 1.0) exactly when ``passes(kept layers)``, else ends +50%."""
    return verify_float8(layers, rec, lambda keep: 1.0 if passes(set(keep)) else 1.5, bf16_loss=1.0, tolerance=0.02,
                         **kwargs)


def test_a_recommendation_keeping_every_layer_is_bf16_mixed_without_a_probe_and_one_keeping_none_is_probed():
    layers = _layers(a=0.0)
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "the first", "a": "its input", "last": "the last"}}
    assert _filters(layers, rec, lambda keep: True) == {
        "recipe": "tensorwise", "ranking": [], "max_probes": 4, "probes": [], "fp8": False,
        "keep_in_bf16": rec["keep_in_bf16"], "converted": [],
        "reason": "no Linear layer is left to convert to float8 (`first`: the first; `a`: its input; `last`: the "
                  "last). Train this model in bf16-mixed."}
    none_kept = _filters(layers, {"recipe": "tensorwise", "keep_in_bf16": {}}, lambda keep: True)
    assert none_kept["fp8"] and len(none_kept["probes"]) == 2


def test_a_verified_filter_says_its_gap_and_labels_each_probe_by_what_it_keeps():
    layers = _layers(a=0.0, b=0.0)
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "", "last": "", "a": "its input"}}
    got = verify_float8(layers, rec, lambda keep: time.sleep(0.01) or 1.0, bf16_loss=1.0, tolerance=0.02)
    assert got["reason"] == "its loss probe ends +0.00% against bf16-mixed, within the tolerance of 2.00%"
    assert [p["label"] for p in got["probes"]] == [
        "fp8, torchao's default filter (the first and the last Linear in bf16)", "fp8, recommended filter (+ a)"]
    assert all(0.01 <= p["seconds"] < 60 for p in got["probes"]) and got["max_probes"] == 4


def test_the_search_prunes_every_layer_added_before_the_last_within_its_budget_of_four_probes():
    layers = _layers(a=0.5, b=0.4, c=0.3, d=0.0)  # ranked a, b, c, d
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "", "last": ""}}
    needs_b_and_c = lambda keep: {"b", "c"} <= keep  # noqa: E731
    labels = ["search 1: + a", "search 2: + b", "search 3: + c", "prune 4: - a", "prune 5: - b"]
    wide = _filters(layers, rec, needs_b_and_c, max_probes=6)
    assert [p["label"] for p in wide["probes"]][1:] == labels and set(wide["keep_in_bf16"]) == {"first", "last", "b", "c"}
    default = _filters(layers, rec, needs_b_and_c)  # four probes past the first: no prune of b
    assert [p["label"] for p in default["probes"]][1:] == labels[:4]
    spent = _filters(layers, rec, lambda keep: "b" in keep, max_probes=2)  # passes with the budget's last probe
    assert [p["label"] for p in spent["probes"]][1:] == labels[:2]
    first = _filters(layers, rec, lambda keep: "a" in keep)  # the first search probe passes: nothing to prune
    assert [p["label"] for p in first["probes"]][1:] == labels[:1]


def test_a_refusal_names_the_closest_filter_and_the_signals_at_or_above_their_limit_or_says_none_is_suspect():
    rec = {"recipe": "tensorwise", "keep_in_bf16": {"first": "", "last": ""}}

    def losses(keep):  # each layer kept brings the loss closer, never within the tolerance
        return 1.5 - 0.125 * len(set(keep) - {"first", "last"})

    at_limit = verify_float8(_layers(a=0.01, b=0.0), rec, losses, bf16_loss=1.0, tolerance=0.02, max_probes=0)
    assert "the closest, keeping `first`, `last` in bf16, ended +50.00%" in at_limit["reason"]
    assert "`a`: input flushed (1.0% of its input flushes to zero in e4m3)" in at_limit["reason"]  # severity 1: named
    assert "keeping one more layer would leave nothing" not in at_limit["reason"]  # two ranked, none added
    searched = verify_float8(_layers(a=0.005, b=0.0), rec, losses, bf16_loss=1.0, tolerance=0.02)
    assert "the closest, keeping `a`, `first`, `last` in bf16, ended +37.50%" in searched["reason"]
    assert "; keeping one more layer would leave nothing in float8" in searched["reason"]
    assert ". No signal the probe measured is suspect (the worst: `a`, input flushed, severity 0.50: 0.5% of its " \
           "input flushes to zero in e4m3)" in searched["reason"]
    single = verify_float8(_layers(a=0.0), rec, losses, bf16_loss=1.0, tolerance=0.02, max_probes=0)
    assert "; keeping one more layer would leave nothing in float8" in single["reason"]  # one ranked

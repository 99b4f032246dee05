"""resolve_precision: every name and alias, auto's choice and reason, emulation warnings."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from mixprec import PrecisionPerformanceWarning, PrecisionPolicy, hardware, precision_names, resolve_precision
from mixprec.hardware import DeviceCapability, choose_auto

ALIASES = {
    "fp32": ["fp32", "no", "32", "32-true", "fp32-true"],
    "fp16-mixed": ["fp16-mixed", "fp16", "16", "16-mixed"],
    "bf16-mixed": ["bf16", "bf16-mixed"],
    "bf16-true": ["bf16-true"],
    "fp8": ["fp8", "fp8-mixed", "float8"],
}


@pytest.mark.parametrize("canon, alias", [(c, a) for c, al in ALIASES.items() for a in al])
def test_every_alias_resolves_to_its_canonical_policy(canon, alias):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        assert resolve_precision(alias, "cpu").name == canon
        assert resolve_precision(alias.upper(), "cpu").name == canon


def test_integer_names_are_accepted_like_lightning():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        assert resolve_precision(16, "cpu").name == "fp16-mixed"
    assert resolve_precision(32, "cpu").name == "fp32"


def test_policies_say_dtypes_autocast_and_scaler():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        fp16 = resolve_precision("fp16", "cpu")
    assert (fp16.compute_dtype, fp16.param_dtype, fp16.autocast_enabled, fp16.needs_loss_scaler) == (
        torch.float16, torch.float32, True, True)
    bf16 = resolve_precision("bf16", "cpu")
    assert (bf16.compute_dtype, bf16.param_dtype, bf16.autocast_enabled, bf16.needs_loss_scaler) == (
        torch.bfloat16, torch.float32, True, False)
    true = resolve_precision("bf16-true", "cpu")
    assert (true.compute_dtype, true.param_dtype, true.autocast_enabled) == (torch.bfloat16, torch.bfloat16, False)
    fp32 = resolve_precision("no", "cpu")
    assert (fp32.compute_dtype, fp32.autocast_enabled, fp32.needs_loss_scaler) == (torch.float32, False, False)


def test_policy_is_frozen():
    with pytest.raises(AttributeError):
        resolve_precision("fp32").name = "bf16-mixed"


def test_unknown_name_lists_every_valid_name_and_alias():
    with pytest.raises(ValueError) as info:
        resolve_precision("fp12")
    msg = str(info.value)
    for aliases in ALIASES.values():
        for alias in aliases:
            assert alias in msg
    assert "auto" in msg


@pytest.mark.parametrize("bad", [None, 1.5, True, ["fp16"]])
def test_non_string_names_are_rejected_with_valid_names(bad):
    with pytest.raises(ValueError, match="Valid names"):
        resolve_precision(bad)


def test_policy_name_must_be_concrete():
    with pytest.raises(ValueError, match="resolve_precision"):
        PrecisionPolicy(name="auto", compute_dtype=torch.float32, param_dtype=torch.float32,
                        optimizer_state_dtype=torch.float32, autocast_enabled=False, needs_loss_scaler=False)


def test_precision_names_lists_canonical_with_aliases():
    names = precision_names()
    assert set(names) == {"fp32", "fp16-mixed", "bf16-mixed", "bf16-true", "fp8", "auto"}
    assert "no" in names["fp32"] and "16-mixed" in names["fp16-mixed"]


def test_autocast_context_runs_matmul_in_compute_dtype():
    x = torch.randn(4, 4)
    with resolve_precision("bf16", "cpu").autocast("cpu"):
        assert (x @ x).dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        policy = resolve_precision("fp16", "cpu")
    with policy.autocast(torch.device("cpu")):
        assert (x @ x).dtype == torch.float16


def test_fp32_autocast_is_a_no_op_inside_an_outer_autocast():
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with resolve_precision("fp32").autocast("cpu"):
            assert (x @ x).dtype == torch.bfloat16


def cap(device="cpu", cc=None, **support):
    full = {"fp32": "native", "fp16-mixed": "native", "bf16-mixed": "native", "bf16-true": "native"}
    full.update({k.replace("_", "-"): v for k, v in support.items()})
    reasons = {k: f"no {k} here" for k, v in full.items() if v != "native"}
    return DeviceCapability(device=device, name="test", flags={}, compute_capability=cc, support=full, reasons=reasons)


def test_auto_prefers_native_bf16():
    name, reason = choose_auto(cap("cuda:0", (9, 0)))
    assert name == "bf16-mixed" and "9.0" in reason


def test_auto_takes_fp16_on_cuda_without_native_bf16():
    name, reason = choose_auto(cap("cuda:0", (7, 5), bf16_mixed="emulated", bf16_true="emulated"))
    assert name == "fp16-mixed" and "bf16" in reason


def test_auto_falls_back_to_fp32_on_a_cpu_without_bf16():
    name, reason = choose_auto(cap("cpu", bf16_mixed="emulated", bf16_true="emulated", fp16_mixed="emulated"))
    assert name == "fp32" and "bf16" in reason


def test_auto_says_what_it_chose_and_why():
    policy = resolve_precision("auto", "cpu")
    expected, _ = choose_auto(hardware.detect_capability("cpu"))
    assert policy.name == expected and policy.requested == "auto" and policy.reason


def test_emulated_precision_warns_naming_the_missing_instruction_set(monkeypatch):
    fake = cap("cpu", bf16_mixed="emulated", bf16_true="emulated")
    fake.reasons["bf16-mixed"] = "this CPU has neither AMX-BF16 nor AVX512-BF16"
    monkeypatch.setattr("mixprec.precision.names.detect_capability", lambda device=None: fake)
    with pytest.warns(PrecisionPerformanceWarning, match="AMX-BF16"):
        assert resolve_precision("bf16", "cpu").name == "bf16-mixed"


def flags_of(**present):
    """A CPU's flags: those named present, every other absent."""
    return {f: present.get(f, False) for f in hardware._CPU_FLAGS}


@pytest.mark.parametrize("present, fastest", [
    (dict(avx2=True), "fp32"),                                                  # an AVX2-only CPU: bf16 is emulated too
    (dict(avx2=True, avx512_f=True, avx512_bf16=True), "bf16-mixed"),           # native bf16 (an AMD EPYC, say)
], ids=["avx2-only", "native-bf16"])
def test_the_emulation_warning_advises_the_fastest_choice_on_the_cpu_at_hand(monkeypatch, present, fastest):
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: flags_of(**present))
    fake = hardware._cpu_capability()
    monkeypatch.setattr("mixprec.precision.names.detect_capability", lambda device=None: fake)
    with pytest.warns(PrecisionPerformanceWarning) as seen:
        resolve_precision("fp16", "cpu")
    text = str(seen[0].message)
    assert f"Use {fastest}, the fastest choice on cpu" in text and "40-200x slower than fp32" in text
    assert text.count("bf16-mixed") == (fastest == "bf16-mixed")  # never advised where it is emulated


def test_the_emulation_warning_is_said_once_per_process_whatever_the_call_site_or_filter_resets(monkeypatch):
    from mixprec import Accelerator
    from mixprec.precision import names

    monkeypatch.setattr(names, "_SAID", set())  # as a fresh process starts
    fake = cap("cpu", fp16_mixed="emulated")
    monkeypatch.setattr("mixprec.precision.names.detect_capability", lambda device=None: fake)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(2):
            resolve_precision("fp16", "cpu")
            Accelerator(cpu=True, mixed_precision="fp16")
            warnings.resetwarnings()  # what transformers and pytest do between two Accelerators
            warnings.simplefilter("default")
    assert len([w for w in seen if issubclass(w.category, PrecisionPerformanceWarning)]) == 1


def test_an_ignored_emulation_warning_is_still_said_later_and_always_means_always(monkeypatch):
    from mixprec.precision import names

    monkeypatch.setattr(names, "_SAID", set())
    fake = cap("cpu", fp16_mixed="emulated")
    monkeypatch.setattr("mixprec.precision.names.detect_capability", lambda device=None: fake)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("ignore", PrecisionPerformanceWarning)
        resolve_precision("fp16", "cpu")  # a tool that says it itself
        warnings.simplefilter("default")
        resolve_precision("fp16", "cpu")
        resolve_precision("fp16", "cpu")
        warnings.simplefilter("always")
        resolve_precision("fp16", "cpu")
    assert len([w for w in seen if issubclass(w.category, PrecisionPerformanceWarning)]) == 2


def test_unsupported_precision_is_an_error(monkeypatch):
    fake = cap("cuda:0", (6, 1), bf16_mixed="unsupported")
    monkeypatch.setattr("mixprec.precision.names.detect_capability", lambda device=None: fake)
    with pytest.raises(ValueError, match="not supported"):
        resolve_precision("bf16", "cuda")


def test_cpu_without_bf16_instructions_reports_emulated(monkeypatch):
    flags = {f: False for f in hardware._CPU_FLAGS}
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: flags)
    c = hardware._cpu_capability()
    assert c.support["bf16-mixed"] == "emulated" and "AVX512-BF16" in c.reasons["bf16-mixed"]
    assert c.support["fp16-mixed"] == "emulated" and "AMX-FP16" in c.reasons["fp16-mixed"]
    assert choose_auto(c)[0] == "fp32"


def test_cpu_without_any_fp16_matrix_kernel_calls_fp16_impractical_but_avx512_fp16_only_emulated(monkeypatch):
    flags = {f: False for f in hardware._CPU_FLAGS}
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: flags)
    bare = hardware._cpu_capability()
    assert "40-200x slower than fp32" in bare.impractical["fp16-mixed"] and "bf16" not in bare.reasons["fp16-mixed"]
    flags["avx512_fp16"] = True
    fp16_vectors = hardware._cpu_capability()
    assert fp16_vectors.support["fp16-mixed"] == "emulated" and "fp16-mixed" not in fp16_vectors.impractical
    assert "no faster than fp32" in fp16_vectors.reasons["fp16-mixed"]


def test_cpu_flags_match_torch_report_where_it_exists():
    if not hasattr(torch.cpu, "get_capabilities"):
        pytest.skip("torch has no CPU capability report")
    report = torch.cpu.get_capabilities()
    flags = hardware.detect_capability("cpu").flags
    assert flags["amx_bf16"] == bool(report.get("amx_bf16"))
    assert flags["avx512_bf16"] == bool(report.get("avx512_bf16"))


def test_with_torch_held_to_avx2_kernels_auto_finds_no_native_16_bit_format():
    """``ATEN_CPU_CAPABILITY=avx2`` (torch's own switch; what an AVX2-only CPU gives): the AVX512
    and AMX flags do not count, so auto picks what it picks on such a CPU."""
    import subprocess
    import sys

    probe = ("from mixprec.hardware import detect_capability; from mixprec.precision import resolve_precision; "
             "c = detect_capability('cpu'); print(c.flags['avx512_bf16'], c.flags['amx_bf16'], c.flags['avx2'], "
             "resolve_precision('auto').name)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["False", "False"] and out.stdout.split()[3] == "fp32", out.stdout


def test_unknown_device_type_is_an_error():
    with pytest.raises(ValueError, match="supports 'cpu', 'cuda' and 'mps'"):
        hardware._detect("meta")


def test_cpu_without_avx512_calls_bf16_impractical_but_avx512_without_bf16_only_emulated(monkeypatch):
    """As fp16: where only a generic kernel computes bf16 products (measured 20-110x below fp32 with
    oneDNN held to AVX2), the bench's defaults leave bf16 out; AVX512's emulation (~0.4x) stays."""
    flags = {f: False for f in hardware._CPU_FLAGS}
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: flags)
    bare = hardware._cpu_capability()
    for p in ("bf16-mixed", "bf16-true"):
        assert bare.support[p] == "emulated" and "generic kernel" in bare.impractical[p] == bare.reasons[p]
    flags["avx512_f"] = True
    avx512 = hardware._cpu_capability()
    assert avx512.support["bf16-mixed"] == "emulated" and "bf16-mixed" not in avx512.impractical
    assert "AVX512-BF16" in avx512.reasons["bf16-mixed"] and choose_auto(avx512)[0] == "fp32"

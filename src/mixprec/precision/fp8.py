"""fp8: the Linear layers' matrix products in float8 through torchao's float8 training, the rest of
the model under bf16 autocast, fp32 master weights and optimizer.

Each chosen ``nn.Linear`` becomes torchao's ``Float8Linear`` (``convert_to_float8_training``): its
input and weight are cast to e4m3 and its output gradient to e5m2, each with a scale (per tensor,
per row) computed from the tensor's absolute maximum at that step, so no scaling state is kept
between steps. On CUDA with compute capability 8.9 or newer the products run in torchao's float8
kernels; elsewhere torchao emulates them (the same quantisation, so the same numerics as the GPU
recipe, at a cost), which :func:`mixprec.resolve_precision` says with a warning.

Which layers: :func:`float8_layer_choice` decides, and records why each layer left in bf16 is
left there: dimensions the float8 kernels cannot take (not multiples of 16), the first and the
last Linear (they see the raw inputs and make the outputs; torchao's recommendation), or the
user's filter (``PrecisionConfig(fp8_filter=...)``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.precision.config import FP8_RECIPES
from mixprec.precision.mixed import MixedPrecision

__all__ = ["FP8_RECIPES", "Float8Precision", "float8_casts", "float8_layer_choice", "load_fp8_filter",
           "quantise_float8", "torchao_float8"]

_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def torchao_float8() -> Any:
    """torchao's ``float8`` module, or an ``ImportError`` that says what to install."""
    try:
        import torchao.float8 as float8
    except ImportError as e:  # pragma: no cover - torchao is in the dev install
        raise ImportError("precision 'fp8' trains with torchao's float8 Linear layers: pip install torchao "
                          "(or mixprec[fp8]); or choose bf16-mixed") from e
    return float8


def float8_layer_choice(model: torch.nn.Module,
                        keep: Callable[[torch.nn.Module, str], bool] | list[str] | tuple[str, ...] | None = None,
                        ) -> dict[str, str | None]:
    """For each ``nn.Linear`` of ``model`` (by name, in module order): ``None`` where it trains in
    float8, else why it stays in bf16.

    Args:
        model: the model, before conversion.
        keep: the user's choice instead of the first-and-last rule: a list of layer names to keep
            in bf16 (what ``mixprec doctor`` recommends), or torchao's ``module_filter_fn``
            signature ``(module, name) -> bool`` (``True``: convert). Layers whose dimensions are
            not multiples of 16 stay in bf16 whatever it says (the kernels cannot take them).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 16))
        >>> float8_layer_choice(net)
        {'0': 'the first Linear layer', '1': None, '2': 'the last Linear layer'}
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    names = [n for n, _ in linears]
    if isinstance(keep, (list, tuple, set)):
        unknown = sorted(set(keep) - set(names))
        if unknown:
            raise ValueError(f"fp8_filter names {unknown}, which are not Linear layers of the model; "
                             f"its Linear layers are {names}")
    choice: dict[str, str | None] = {}
    for i, (name, m) in enumerate(linears):
        if m.in_features % 16 or m.out_features % 16:
            choice[name] = f"{m.out_features}x{m.in_features}: not multiples of 16, which the float8 kernels need"
        elif keep is None and i == 0:
            choice[name] = "the first Linear layer"
        elif keep is None and i == len(linears) - 1:
            choice[name] = "the last Linear layer"
        elif isinstance(keep, (list, tuple, set)) and name in keep:
            choice[name] = "kept in bf16 by the filter"
        elif callable(keep) and not keep(m, name):
            choice[name] = "kept in bf16 by the filter"
        else:
            choice[name] = None
    return choice


def load_fp8_filter(path: str | Any) -> dict[str, Any]:
    """The fp8 settings ``mixprec doctor --precision fp8 --write-filter FILE`` wrote, as
    :class:`~mixprec.precision.PrecisionConfig` fields: ``PrecisionConfig(**load_fp8_filter(FILE))``
    (``fp8_recipe``, and ``fp8_filter``: the Linear layers kept in bf16)."""
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("fp8_filter"), list):
        raise ValueError(f"{path} is not an fp8 filter (a JSON object with 'fp8_filter', a list of layer names, "
                         "as `mixprec doctor --precision fp8 --write-filter` writes)")
    return {"fp8_recipe": data.get("fp8_recipe", "tensorwise"), "fp8_filter": tuple(data["fp8_filter"])}


def quantise_float8(x: torch.Tensor, dtype: torch.dtype, *, dim: int | None = None,
                    power_of_2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as torchao's float8 training casts it: the scale ``finfo(dtype).max / amax`` (per
    tensor, or per slice along ``dim`` for the rowwise recipes; rounded down to a power of 2 when
    ``power_of_2``), then ``x * scale`` saturated to the format. Returns ``(bits, scale)``:
    ``bits.float() / scale`` is what the matrix product sees.

    Example:
        >>> bits, scale = quantise_float8(torch.tensor([1.0, -3.0, 1e-6]), torch.float8_e4m3fn)
        >>> bits.float().tolist(), round(float(scale), 3)
        ([144.0, -448.0, 0.0], 149.333)
    """
    with torch.no_grad():
        amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
        scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=1e-12)).to(torch.float32)
        if power_of_2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        limit = torch.finfo(dtype).max
        bits = (x.to(torch.float32) * scale).clamp(-limit, limit).to(dtype)
    return bits, scale


def float8_casts(config: Any) -> dict[str, dict[str, Any]]:
    """The casts a float8 ``Linear`` makes under torchao's ``Float8LinearConfig``, by role, as
    keyword arguments of :func:`quantise_float8` (``None`` where the recipe leaves it in high
    precision): ``input`` and ``weight`` (forward, ``y = x @ W^T``; ``weight`` is W's transpose as
    torchao casts it), ``grad_output`` and ``weight_for_grad_input`` (W's transpose again, for the
    input's gradient)."""
    roles = {"input": (config.cast_config_input, -1), "weight": (config.cast_config_weight, 0),
             "grad_output": (config.cast_config_grad_output, -1),
             "weight_for_grad_input": (config.cast_config_weight_for_grad_input, -1)}
    out: dict[str, dict[str, Any]] = {}
    for role, (cast, axis) in roles.items():
        if cast.scaling_type.value == "disabled":
            out[role] = None
            continue
        out[role] = {"dtype": cast.target_dtype, "dim": axis if cast.scaling_granularity.value == "axiswise" else None,
                     "power_of_2": bool(config.round_scales_to_power_of_2)}
    return out


class Float8Precision(MixedPrecision):
    """fp8: chosen Linear layers in float8 (torchao), the rest as bf16-mixed.

    Args:
        policy: the resolved fp8 policy (bf16 autocast around the float8 layers).
        device: the device the run trains on; float8 kernels need CUDA 8.9+, elsewhere torchao
            emulates them.
        config: a :class:`~mixprec.precision.PrecisionConfig`: ``fp8_recipe`` (``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``, or torchao's own ``Float8LinearConfig``) and
            ``fp8_filter`` (see :func:`float8_layer_choice`).

    Example:
        >>> from mixprec.precision import make_plugin
        >>> import warnings; warnings.simplefilter("ignore")
        >>> plugin = make_plugin("fp8", "cpu")
        >>> net = plugin.convert_module(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]))
        >>> type(net[1]).__name__, plugin.layers["1"]
        ('Float8Linear', 'float8 (tensorwise)')
    """

    def __init__(self, policy: Any, device: str | torch.device, config: Any = None) -> None:
        super().__init__(policy, device, config)
        self._float8 = torchao_float8()
        dev = self.device
        self.emulated = not (dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 9))
        #: Linear layer name -> ``"float8 (<recipe>)"``, or why it stays in bf16 (filled by convert_module).
        self.layers: dict[str, str] = {}
        #: The float8 dtypes seen produced inside the first forward (empty until then).
        self.seen_in_forward: set[torch.dtype] = set()
        self._witnessed = False

    @property
    def recipe(self) -> str:
        """The recipe's name (``"custom"`` for a torchao config given as it is)."""
        r = self.config.fp8_recipe
        return r if isinstance(r, str) else "custom"

    def float8_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for the recipe, emulated where there are no kernels;
        under FSDP2 with tensorwise scaling (the recipe torchao all-gathers in float8), the
        weights are all-gathered in float8: half the bytes of bf16 on the wire, the same numbers."""
        r = self.config.fp8_recipe
        config = self._float8.Float8LinearConfig.from_recipe_name(r) if isinstance(r, str) else r
        changes: dict[str, Any] = {}
        if self.emulated and not config.emulate:
            changes["emulate"] = True
        if self.sharded and r == "tensorwise":
            changes["enable_fsdp_float8_all_gather"] = True
        return dataclasses.replace(config, **changes) if changes else config

    @property
    def float8_all_gather(self) -> bool:
        """Whether the sharded weights are all-gathered in float8 (FSDP2, tensorwise)."""
        return bool(self.float8_config().enable_fsdp_float8_all_gather)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        super().convert_module(module)  # (a CPU run's weights in fp16 beside bf16 autocast: upcast)
        choice = float8_layer_choice(module, self.config.fp8_filter)
        chosen = {name for name, why in choice.items() if why is None}
        self.layers = {name: (f"float8 ({self.recipe})" if why is None else f"bf16: {why}")
                       for name, why in choice.items()}
        if "" in chosen:
            raise ValueError("the model is one Linear layer: fp8 converts the layers inside a model; "
                             "wrap it in a module, or use bf16-mixed")
        if chosen:
            self._float8.convert_to_float8_training(module, config=self.float8_config(),
                                                    module_filter_fn=lambda m, fqn: fqn in chosen)
        return module

    def forward_context(self) -> contextlib.AbstractContextManager:
        # is_compiling() first: a compiled forward then reads (and guards on) nothing of the witness.
        if torch.compiler.is_compiling() or self._witnessed or \
                not any(v.startswith("float8") for v in self.layers.values()):
            return super().forward_context()
        self._witnessed = True
        return self._witness()

    @contextlib.contextmanager
    def _witness(self) -> Iterator[None]:
        """The first forward, under autocast and a dispatch mode that records the float8 dtypes the
        operators produce: proof that the casts happen, for ``precision_report``."""
        with super().forward_context(), _DtypeWitness(self.seen_in_forward):
            yield

    def report(self) -> dict[str, Any]:
        """What ``precision_report`` adds for fp8: the layers and what they run in, the recipe,
        whether the kernels are torchao's or emulated, the float8 dtypes seen in forward."""
        seen = sorted(str(d).replace("torch.", "") for d in self.seen_in_forward)
        kernels = "emulated by torchao" if self.emulated else "torchao's float8 kernels"
        n = sum(v.startswith("float8") for v in self.layers.values())
        summary = (f"{n} of {len(self.layers)} Linear layers in float8 ({self.recipe}, {kernels}); float8 made in "
                   f"forward: {', '.join(seen) if seen else ('none' if self._witnessed else 'not observed yet')}")
        return {"recipe": self.recipe, "kernels": kernels, "layers": dict(self.layers), "float8_in_forward": seen,
                "float8_all_gather": self.float8_all_gather, "summary": summary}

    def violations(self) -> list[str]:
        converted = [n for n, v in self.layers.items() if v.startswith("float8")]
        if self._witnessed and converted and not self.seen_in_forward:
            return [f"{len(converted)} Linear layers were converted to float8, but the first forward made no "
                    "float8 tensor: their matrix products did not run in float8"]
        return []


class _DtypeWitness(TorchDispatchMode):
    """Records the float8 dtypes of every operator's tensor outputs while active."""

    def __init__(self, seen: set[torch.dtype]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in _FLOAT8:
                self.seen.add(t.dtype)
        return out

"""The damage of quantizing one unit alone: per unit and format, KL(baseline || variant) per
token and top-1 agreement on held-out text, with the unit's weight bytes in that format.

Each unit's layers are quantized with the field's own code: compressed-tensors' quantization
scheme on those modules (the same arguments the emitted recipe gives GPTQ:
:data:`pipeline.search.recipe.FORMATS`), weight scales from llmcompressor's observers,
compressed-tensors' fake quantization in the forward pass (dynamic activations included); the
layers are then put back as they were. Round-to-nearest, not GPTQ: the scan ranks units; the
searched recipe's measured damage says how far the prediction holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.core.heldout import token_stats
from pipeline.plan.architecture import Matrix
from pipeline.plan.capacity import weight_formats
from pipeline.search.recipe import FORMATS, KEEP

INT4_GROUP = FORMATS["int4"]["weights"]["group_size"]


@dataclass(frozen=True)
class Damage:
    """One unit in one format."""

    unit: str
    format: str
    bytes: int
    kl_div_mean: float  # nats per token
    top1_agreement: float


def unit_bytes(modules: list[Any], fmt: str) -> int:
    """The unit's weights stored in ``fmt`` (the planner's storage formats)."""
    storage = weight_formats(int4_group_size=INT4_GROUP)[fmt]
    return sum(storage.matrix_bytes(Matrix(m.weight.shape[0], m.weight.shape[1]))
               for m in modules)


def _quantize_in_place(module: Any, fmt: str) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.initialize import (
        initialize_module_for_quantization,
    )
    from llmcompressor.modifiers.quantization.calibration import (
        freeze_module_quantization,
        initialize_observer,
        observe,
        update_qparams,
    )

    spec = FORMATS[fmt]
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**spec["weights"]),
        input_activations=QuantizationArgs(**spec["input_activations"])
        if "input_activations" in spec else None)
    initialize_module_for_quantization(module, scheme)
    initialize_observer(module, "weight")
    observe(module, "weight")
    update_qparams(module, "weight")
    freeze_module_quantization(module)


def _log_probs(model: Any, windows: list[list[int]]) -> list[Any]:
    """Each window's next-token log-probabilities, on the host (kept for every unit)."""
    import torch

    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([w], device=model.device)).logits[0, :-1]
                                  .float(), dim=-1).cpu() for w in windows]


def _kl(base: list[Any], varied: list[Any], windows: list[list[int]]) -> tuple[float, float]:
    """(mean KL(base || varied) per token, top-1 agreement) over ``windows``."""
    import torch

    kl = agree = count = 0.0
    for b, v, w in zip(base, varied, windows, strict=True):
        stats = token_stats(b, v, torch.tensor(w[1:]))
        kl += float(stats["kl"].sum())
        agree += float(stats["agree"].sum())
        count += len(w) - 1
    return kl / count, agree / count


class _Quantized:
    """``units`` of ``model`` quantized in place as ``choice`` says (round-to-nearest), and put
    back as they were on exit."""

    def __init__(self, model: Any, units: dict[str, list[str]], choice: dict[str, str]) -> None:
        self.model, self.units, self.choice = model, units, choice
        self.originals: dict[str, Any] = {}

    def __enter__(self) -> _Quantized:
        named = dict(self.model.named_modules())
        for unit, fmt in self.choice.items():
            if fmt == KEEP:
                continue
            for n in self.units[unit]:
                self.originals[n] = copy.deepcopy(named[n])
                _quantize_in_place(named[n], fmt)
        return self

    def __exit__(self, *_: object) -> None:
        for n, original in self.originals.items():
            _put(self.model, n, original)


def whole_damage(model: Any, units: dict[str, list[str]], choice: dict[str, str],
                 windows: list[list[int]]) -> float:
    """The KL of the whole mix at once (every unit as ``choice`` says, round-to-nearest), on
    ``windows``: what the summed per-unit damages predict, without assuming they add up."""
    base = _log_probs(model, windows)
    with _Quantized(model, units, choice):
        varied = _log_probs(model, windows)
    return _kl(base, varied, windows)[0]


def in_context(model: Any, units: dict[str, list[str]], formats: list[str],
               choice: dict[str, str], windows: list[list[int]],
               progress: Callable[[int, int, list[Damage]], None] | None = None
               ) -> tuple[float, list[Damage]]:
    """Each unit re-scored in the context of ``choice``: (the whole mix's KL, per unit and
    format the KL of the mix with that unit in that format instead, minus the mix's). Where
    most units are 4-bit, damages do not add up; these marginal damages are the mix's own."""
    base = _log_probs(model, windows)
    out = []
    with _Quantized(model, units, choice) as mixed:
        mix = _kl(base, _log_probs(model, windows), windows)[0]
        named = dict(model.named_modules())
        for i, (unit, names) in enumerate(units.items()):
            held = {n: named[n] for n in names}  # the mix's modules of this unit
            for fmt in formats:
                size = unit_bytes([mixed.originals.get(n, held[n]) for n in names], fmt)
                if fmt == choice[unit]:
                    out.append(Damage(unit, fmt, size, 0.0, 1.0))
                    continue
                try:
                    for n in names:
                        fresh = copy.deepcopy(mixed.originals.get(n, held[n]))
                        if fmt != KEEP:
                            _quantize_in_place(fresh, fmt)
                        _put(model, n, fresh)
                    kl, agree = _kl(base, _log_probs(model, windows), windows)
                finally:
                    for n, module in held.items():
                        _put(model, n, module)
                out.append(Damage(unit, fmt, size, kl - mix, agree))
            if progress:
                progress(i + 1, len(units), out[-len(formats):])
    return mix, out


def _put(model: Any, name: str, module: Any) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def scan(model: Any, units: dict[str, list[str]], formats: list[str],
         windows: list[list[int]],
         progress: Callable[[int, int, list[Damage]], None] | None = None) -> list[Damage]:
    """Every unit in every format of ``formats`` (bf16: no damage, not run), on ``model``
    as loaded (left as it was)."""
    import torch

    for fmt in formats:
        if fmt != KEEP and fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {', '.join([*FORMATS, KEEP])}")
    named = dict(model.named_modules())
    base = _log_probs(model, windows)
    targets = [torch.tensor(w[1:]) for w in windows]
    out = []
    for i, (unit, names) in enumerate(units.items()):
        modules = [named[n] for n in names]
        for fmt in formats:
            if fmt == KEEP:
                out.append(Damage(unit, fmt, unit_bytes(modules, fmt), 0.0, 1.0))
                continue
            originals = {n: copy.deepcopy(named[n]) for n in names}
            try:
                for n in names:
                    _quantize_in_place(named[n], fmt)
                varied = _log_probs(model, windows)
            finally:
                for n, original in originals.items():
                    parent, _, leaf = n.rpartition(".")
                    setattr(model.get_submodule(parent), leaf, original)
                    named[n] = original
            kl = agree = count = 0.0
            for b, v, t in zip(base, varied, targets, strict=True):
                stats = token_stats(b, v, t)
                kl += float(stats["kl"].sum())
                agree += float(stats["agree"].sum())
                count += len(t)
            out.append(Damage(unit, fmt, unit_bytes(modules, fmt), kl / count, agree / count))
        if progress:
            progress(i + 1, len(units), out[-len(formats):])
    return out

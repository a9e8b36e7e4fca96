"""A searched choice of formats as an ordinary llmcompressor recipe (``recipes/<name>.yaml``).

One ``config_group`` per format with the explicit module names it covers (bf16 units go to
``ignore``), and a ``qpipe:`` block saying how the choice was made, so that ``make quantize``,
``bench``, ``eval``, ``gate`` and ``all`` treat it as any shipped recipe. The checkpoint is
quantized by the scan's own method by default, round-to-nearest (llmcompressor's
``QuantizationModifier``, its observers, data-free): what the scan predicted is what ships.
``METHOD=gptq`` quantizes by GPTQ like the shipped int4 and int8 recipes, and the prediction is
then calibrated by the uniform GPTQ variants' measured damage (:mod:`pipeline.search.measured`).
"""

from __future__ import annotations

from typing import Any

import yaml

from pipeline.core import formats
from pipeline.core.errors import ConfigError
from pipeline.search.solver import Choice

KEEP = "bf16"  # the format that is no quantization: the unit's layers are ignored
# The weight (and activation) arguments of each searchable format, from the format table.
FORMATS: dict[str, dict[str, Any]] = {key: dict(fmt.search_args or {})
                                      for key, fmt in formats.SEARCHABLE.items()}
CALIBRATION = {"dataset": "calibration/python-reference.jsonl", "num_samples": 32,
               "max_seq_length": 256, "seed": 42}
# How a searched checkpoint is quantized: the llmcompressor modifier of each method.
RTN, GPTQ = "rtn", "gptq"
METHODS = {RTN: "QuantizationModifier", GPTQ: "GPTQModifier"}


def recipe_text(choice: Choice, units: dict[str, list[str]], how: str, threshold: float,
                extra: dict[str, Any] | None = None, method: str = RTN) -> str:
    """The recipe file's text for ``choice`` (unit -> format over ``units``' layers),
    quantized by ``method`` (:data:`METHODS`)."""
    if method not in METHODS:
        raise ConfigError(f"METHOD={method}: not a quantization method of the search; the "
                          f"methods are {', '.join(METHODS)}")
    unknown = sorted({f for f in choice.formats.values() if f != KEEP and f not in FORMATS})
    if unknown:
        raise ConfigError(f"format(s) {', '.join(unknown)} cannot go in a searched recipe: the "
                          f"formats are {', '.join([*FORMATS, KEEP])}")
    missing = sorted(set(units) - set(choice.formats))
    if missing:
        raise ConfigError(f"the choice has no format for unit(s) {', '.join(missing[:5])}")
    by_format: dict[str, list[str]] = {}
    for unit, layers in units.items():
        by_format.setdefault(choice.formats[unit], []).extend(layers)
    groups = {f"group_{fmt}": {"targets": layers, **FORMATS[fmt]}
              for fmt, layers in sorted(by_format.items()) if fmt != KEEP}
    counts = ", ".join(f"{len(v)} layers {k}" for k, v in sorted(by_format.items()))
    modifier: dict[str, Any] = {"ignore": ["lm_head", *by_format.get(KEEP, [])]}
    if method == GPTQ:
        modifier["dampening_frac"] = 0.01
    modifier["config_groups"] = groups
    recipe = {
        "qpipe": {"description": f"searched mixed precision: {counts}, {method}",
                  "calibration": dict(CALIBRATION) if method == GPTQ else "none",
                  "recovery_threshold_pct": threshold,
                  "search": {"how": how, "method": method,
                             "predicted_damage": round(choice.damage, 6),
                             "weight_bytes": choice.bytes, **(extra or {})}},
        "quantize_stage": {"quantize_modifiers": {METHODS[method]: modifier}},
    }
    head = (f"# Searched by qpipe: {how}.\n# Predicted damage (sum of per-unit KL on held-out "
            f"text): {choice.damage:.6g} nats/token; weights {choice.bytes:,} bytes.\n")
    return head + yaml.safe_dump(recipe, sort_keys=False, width=100)

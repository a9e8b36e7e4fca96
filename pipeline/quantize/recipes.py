"""Find, validate and load recipe files.

A recipe is an llmcompressor recipe YAML that ``oneshot`` consumes as it is; qpipe's own settings
(calibration data, recovery threshold) sit beside it under a top-level ``qpipe:`` key, which
llmcompressor ignores (it reads only ``*_stage`` keys and ``args``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field

from pipeline.core import paths
from pipeline.core.errors import RecipeError
from pipeline.core.settings import StageSettings

QPIPE_KEY = "qpipe"
CALIBRATION_KEYS = {"dataset", "num_samples", "max_seq_length", "seed"}
QPIPE_KEYS = {"description", "calibration", "recovery_threshold_pct", "start_from",
              "search"}  # search: how a searched recipe was chosen (informational)


@dataclass(frozen=True)
class Calibration:
    """Calibration data for recipes that need it (GPTQ, SmoothQuant, static activations)."""

    dataset: str  # a local .jsonl/.json/.parquet file, or a hub dataset id
    num_samples: int = 64
    max_seq_length: int = 256
    seed: int = 42


@dataclass(frozen=True)
class RecipeFile:
    """One recipe file: the llmcompressor stages plus qpipe's settings."""

    name: str
    path: Path
    text: str
    sha256: str
    description: str
    calibration: Calibration | None  # None: data-free (RTN, dynamic activations)
    recovery_threshold_pct: float | None
    stages: dict[str, Any]  # the llmcompressor part, as parsed
    search: dict[str, Any] = dataclasses.field(default_factory=dict)  # qpipe.search: how a
    # searched recipe was chosen (empty for any other)
    start: RecipeFile | None = None  # qpipe.start_from: the recipe whose checkpoint this one
    # adds a KV-cache scheme to, its weights unchanged (None: quantize the baseline)

    @property
    def searched_for(self) -> str | None:
        """A searched recipe: the baseline identity it was made for."""
        return self.search.get("baseline_identity")

    def with_calibration(self, **overrides: Any) -> RecipeFile:
        """A copy with calibration fields overridden (CLI / Makefile); data-free stays data-free."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        start = self.start.with_calibration(**overrides) if self.start else None
        if self.calibration is None or not overrides:
            return dataclasses.replace(self, start=start)
        return dataclasses.replace(
            self, calibration=dataclasses.replace(self.calibration, **overrides), start=start
        )


def available(recipes_dir: Path = paths.RECIPES_DIR) -> list[str]:
    """Names of the recipes in ``recipes/`` (file stems)."""
    return paths.yaml_names(recipes_dir)


def find(name_or_path: str, recipes_dir: Path = paths.RECIPES_DIR) -> Path:
    """A recipe name (``fp8``) or a path to a recipe file."""
    found = paths.find_yaml(name_or_path, recipes_dir)
    if found:
        return found
    names = ", ".join(available(recipes_dir)) or "(none)"
    raise RecipeError(
        f"unknown recipe {name_or_path!r}: the recipes in {recipes_dir} are {names}. "
        "Set RECIPE= to one of them, or to the path of a recipe YAML file."
    )


def load(name_or_path: str, recipes_dir: Path = paths.RECIPES_DIR, *,
         as_start: bool = False) -> RecipeFile:
    """Read and validate a recipe without importing llmcompressor (``as_start``: as another
    recipe's ``start_from``, which must quantize the baseline itself)."""
    path = find(name_or_path, recipes_dir)
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"{where}: malformed YAML ({problem}). Fix the YAML there.") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a YAML mapping with `*_stage` keys, "
                          f"got {type(data).__name__}.")
    stages = {k: v for k, v in data.items() if k.endswith("_stage")}
    if not stages:
        raise RecipeError(f"{path}: no `*_stage` key, so llmcompressor would do nothing. "
                          "See recipes/int4.yaml for the form (quantize_stage -> *_modifiers).")
    settings = data.get(QPIPE_KEY) or {}
    _check_keys(path, text, settings, QPIPE_KEYS, QPIPE_KEY)
    if as_start and settings.get("start_from") is not None:
        raise RecipeError(f"{path} starts from a recipe itself: name a recipe that quantizes "
                          "the baseline (one step of start_from, not a chain).")
    _check_schemes(path, text, stages)
    threshold = settings.get("recovery_threshold_pct")
    if threshold is not None and not isinstance(threshold, (int, float)):
        raise RecipeError(f"{_where(path, text, 'recovery_threshold_pct')}: "
                          "recovery_threshold_pct must be a number (percent, e.g. 96).")
    return RecipeFile(
        name=path.stem,
        path=path,
        text=text,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        description=str(settings.get("description", "")),
        calibration=_calibration(path, text, settings.get("calibration")),
        recovery_threshold_pct=float(threshold) if threshold is not None else None,
        stages=stages,
        search=dict(settings.get("search") or {}),
        start=_start(path, text, settings.get("start_from"), stages, recipes_dir),
    )


def kv_cache_scheme(stages: dict[str, Any]) -> Any:
    """The recipe's ``kv_cache_scheme`` (None if it quantizes no KV cache)."""
    return next((args["kv_cache_scheme"] for _, args in modifiers(stages)
                 if args.get("kv_cache_scheme")), None)


def _start(path: Path, text: str, name: Any, stages: dict[str, Any],
           recipes_dir: Path) -> RecipeFile | None:
    """The recipe ``start_from`` names, checked: this recipe only adds a KV-cache scheme to its
    checkpoint (the weights stay as that recipe made them), and it starts from the baseline."""
    if name is None:
        return None
    where = _where(path, text, "start_from")
    if not isinstance(name, str) or not name:
        raise RecipeError(f"{where}: start_from names a recipe (e.g. int8), got {name!r}.")
    found = modifiers(stages)
    extra = sorted({key for _, args in found for key in args} - {"kv_cache_scheme"})
    if [kind for kind, _ in found] != ["QuantizationModifier"] or extra or \
            not kv_cache_scheme(stages):
        raise RecipeError(
            f"{where}: a recipe that starts from {name}'s checkpoint adds a KV-cache scheme to "
            "it and changes no weight: its stages hold one QuantizationModifier with only "
            f"kv_cache_scheme (found {', '.join(k for k, _ in found) or 'none'}"
            f"{'; with ' + ', '.join(extra) if extra else ''}). Put weight quantization in "
            f"the recipe it starts from, or drop start_from (see recipes/int8-fp8kv.yaml).")
    local = path.parent / f"{name}.yaml"
    try:
        start = load(str(local) if local.is_file() else name, recipes_dir, as_start=True)
    except RecipeError as err:
        raise RecipeError(f"{where}: start_from: {err}") from None
    if kv_cache_scheme(start.stages):
        raise RecipeError(f"{where}: {start.path} already quantizes the KV cache; start from a "
                          "recipe that does not.")
    return start


def modifiers(stages: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(modifier type, its arguments) for every modifier of every stage, in order."""
    out = []
    for stage in stages.values():
        for group_key, group in (stage or {}).items():
            if group_key.endswith("_modifiers") and isinstance(group, dict):
                out.extend((kind, args or {}) for kind, args in group.items())
    return out


def instantiate(recipe: RecipeFile) -> Any:
    """The llmcompressor ``Recipe`` object; its validation errors name this file."""
    from llmcompressor.recipe import Recipe

    try:
        return Recipe.create_instance(str(recipe.path))
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"{recipe.path}: llmcompressor rejects this recipe: {first}") from None


def _calibration(path: Path, text: str, raw: Any) -> Calibration | None:
    if raw in (None, "none", False):
        return None
    if not isinstance(raw, dict):
        raise RecipeError(f"{_where(path, text, 'calibration')}: calibration must be `none` or a "
                          f"mapping with {sorted(CALIBRATION_KEYS)}.")
    _check_keys(path, text, raw, CALIBRATION_KEYS, "calibration")
    if "dataset" not in raw:
        raise RecipeError(f"{_where(path, text, 'calibration')}: calibration.dataset is missing "
                          "(a .jsonl/.json/.parquet file relative to the recipe, or a hub id).")
    for key in ("num_samples", "max_seq_length", "seed"):
        value = raw.get(key)
        minimum = 0 if key == "seed" else 1
        if value is not None and (not isinstance(value, int) or value < minimum):
            raise RecipeError(f"{_where(path, text, key)}: calibration.{key} must be a positive "
                              f"integer, got {value!r}.")
    dataset = str(raw["dataset"])
    local = (path.parent / dataset) if not Path(dataset).is_absolute() else Path(dataset)
    if local.exists():
        dataset = str(local.resolve())
    return Calibration(dataset=dataset, **{k: v for k, v in raw.items() if k != "dataset"})


def _check_keys(path: Path, text: str, mapping: Any, allowed: set[str], section: str) -> None:
    if not isinstance(mapping, dict):
        raise RecipeError(f"{_where(path, text, section)}: `{section}` must be a mapping.")
    for key in mapping:
        if key not in allowed:
            raise RecipeError(f"{_where(path, text, key)}: unknown field `{section}.{key}`; "
                              f"the fields are {', '.join(sorted(allowed))}.")


def _check_schemes(path: Path, text: str, stages: dict[str, Any]) -> None:
    """Preset scheme names must exist in compressed-tensors; say which ones do."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for kind, args in modifiers(stages):
        scheme = args.get("scheme")
        names = [scheme] if isinstance(scheme, str) else list(scheme or {})
        for name in names:
            if str(name).upper() not in PRESET_SCHEMES:
                raise RecipeError(
                    f"{_where(path, text, 'scheme')}: unknown scheme {name!r} in {kind}; the "
                    f"preset schemes are {', '.join(PRESET_SCHEMES)}. Or describe the scheme "
                    "with config_groups (see recipes/int4.yaml)."
                )


def _where(path: Path, text: str, key: str) -> str:
    """``file, line N`` of the first line that sets ``key``."""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip().startswith(f"{key}:"):
            return f"{path}, line {number}"
    return str(path)


class RecipesSettings(StageSettings):
    names: tuple[str, ...] = Field((), description="recipes to show (default: all)",
                                   json_schema_extra={"positional": True})


def run(settings: RecipesSettings) -> int:
    """``qpipe recipes``: list and validate the recipes."""
    for name in settings.names or available():
        recipe = load(name)
        calib = recipe.calibration
        data = (f"{Path(calib.dataset).name} x{calib.num_samples} @ {calib.max_seq_length} tok"
                if calib else "data-free")
        gate = f"gate {recipe.recovery_threshold_pct:g}%" if recipe.recovery_threshold_pct else ""
        print(f"{recipe.name:8s} {recipe.description}  [{data}] {gate}")
    return 0

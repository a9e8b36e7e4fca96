"""One model of a comparison: the baseline or a variant made from it by a recipe.

Every stage uses this one type: bench serves it, eval scores it, report joins it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.core import paths
from pipeline.core.artifacts import Baseline, manifests

BASELINE = "baseline"  # the baseline's name wherever a variant's would be
NO_RECIPE = "none"  # the baseline's recipe as MLflow params record it


@dataclass(frozen=True)
class Variant:
    name: str  # "baseline", or the recipe's name
    path: Path  # a model directory vLLM and transformers load
    identity: str  # the manifest's cache key; the baseline's content hash
    format: str = "dense"  # compressed-tensors format; "dense" for the baseline
    scheme: str = "bf16"

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE

    @property
    def recipe(self) -> str:
        """The recipe's name, ``none`` for the baseline (as MLflow params carry it)."""
        return NO_RECIPE if self.is_baseline else self.name

    @property
    def served_name(self) -> str:
        return self.name


def baseline_variant(base: Baseline) -> Variant:
    return Variant(BASELINE, base.path, base.identity)


def variants_of(base: Baseline, recipes: list[str] | None = None) -> list[Variant]:
    """The variants on disk (or the named ones; a missing one is a clear error)."""
    return [Variant(name, paths.variant_dir(base.name, name), m.cache_key, m.format,
                    m.recipe.scheme)
            for name, m in manifests(base.name, recipes).items()]


def with_baseline(base: Baseline, recipes: list[str] | None = None) -> list[Variant]:
    """The baseline first, then the variants."""
    return [baseline_variant(base), *variants_of(base, recipes)]

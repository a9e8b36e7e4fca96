"""Quantize: resolve the baseline, validate the recipes, run llmcompressor's ``oneshot`` into a
compressed-tensors checkpoint with its manifest (one process per recipe, several at once)."""

from pipeline.quantize.baseline import Baseline, resolve
from pipeline.quantize.parallel import quantize_all
from pipeline.quantize.settings import QuantizeSettings
from pipeline.quantize.stage import run

__all__ = ["Baseline", "QuantizeSettings", "quantize_all", "resolve", "run"]

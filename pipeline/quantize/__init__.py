"""Quantize: resolve the baseline, validate the recipes, run llmcompressor's ``oneshot`` into a
compressed-tensors checkpoint with its manifest."""

from pipeline.quantize.baseline import Baseline, resolve
from pipeline.quantize.settings import QuantizeSettings
from pipeline.quantize.stage import run

__all__ = ["Baseline", "QuantizeSettings", "resolve", "run"]

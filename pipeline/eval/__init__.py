"""Eval: score the baseline and its variants with lm-eval; recovery with honest intervals;
the gate."""

from pipeline.eval.settings import EvalSettings, GateSettings
from pipeline.eval.stage import evaluate, run

__all__ = ["EvalSettings", "GateSettings", "evaluate", "run"]

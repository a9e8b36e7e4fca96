"""Report: join what every stage measured, name the variant to ship, render and log it."""

from pipeline.report.settings import CompareSettings
from pipeline.report.stage import compare_and_log, run

__all__ = ["CompareSettings", "compare_and_log", "run"]

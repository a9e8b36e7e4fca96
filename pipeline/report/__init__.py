"""Report: join what every stage recorded, name the variant to ship, render and log it."""

from pipeline.report.publish import compare_and_log
from pipeline.report.settings import CompareSettings

__all__ = ["CompareSettings", "compare_and_log"]

"""``qpipe compare`` / ``make compare``: the campaign's last step alone, over what the stages
recorded (nothing is re-resolved or re-measured), with a campaign file's plan target, objective
and cost target."""

from __future__ import annotations

from pipeline.campaign import files
from pipeline.core import tracking
from pipeline.core.artifacts import BaselineRecord, Comparison
from pipeline.report import compare_and_log
from pipeline.report.settings import CompareSettings


def run(settings: CompareSettings) -> Comparison:
    """``qpipe compare``: the baseline as its stages recorded it."""
    file = files.with_comparison(files.load(settings.campaign), settings.comparison)
    if settings.track:
        tracking.check_store()
    base = BaselineRecord.find(settings.baseline).baseline()
    comparison, _ = compare_and_log(base, list(settings.recipes) or None, file.plan, "compare",
                                    settings.track, objective=file.objective,
                                    cost_target=file.cost, threshold=file.threshold)
    return comparison

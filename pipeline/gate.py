"""The recovery gate: every task's recovery interval must clear its recipe's threshold.

For each variant, the lower end of each task's 95% recovery interval (from the last
``qpipe eval``, ``artifacts/evals/<baseline>/<recipe>/recovery.json``) is compared with the
recipe's ``recovery_threshold_pct``. Tasks whose baseline is within noise of chance cannot
pass or fail and are listed as such; a variant with no meaningful task fails.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pipeline import baseline as baselines
from pipeline import evaluate, paths, recipes
from pipeline.errors import ConfigError, QpipeError, RecipeError
from pipeline.fsutil import read_json


class GateFailed(QpipeError):
    """A variant's recovery falls below its recipe's threshold."""

    exit_code = 1


@dataclass(frozen=True)
class Verdict:
    recipe: str
    threshold: float
    passed: list[str]  # one line per task
    failed: list[str]
    skipped: list[str]  # not meaningful

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.passed)


def threshold_of(recipe: str, variant_dir: Path, override: float | None = None) -> float:
    """``--threshold``, else ``recipes/<recipe>.yaml``, else the recipe copy in the variant."""
    if override is not None:
        return override
    for source in (recipe, str(variant_dir / "qpipe_recipe.yaml")):
        try:
            value = recipes.load(source).recovery_threshold_pct
        except RecipeError:
            continue
        if value is not None:
            return value
    raise ConfigError(
        f"recipe {recipe!r} has no qpipe.recovery_threshold_pct (looked in recipes/{recipe}.yaml "
        f"and {variant_dir / 'qpipe_recipe.yaml'}). Fix: add `recovery_threshold_pct: 96` under "
        "`qpipe:` in the recipe, or pass --threshold.")


def judge(summary: dict, recipe: str, threshold: float) -> Verdict:
    """Compare each task's interval (its primary metric) with ``threshold``."""
    passed, failed, skipped = [], [], []
    for task, entry in sorted(summary.get("tasks", {}).items()):
        r = entry["recovery"].get(entry["primary_metric"])
        if r is None:
            continue
        mark = " [emulated]" if entry.get("backend") == evaluate.EMULATED else ""
        if not r["meaningful"] or r["recovery_pct"] is None or r["ci_low"] is None:
            skipped.append(f"{task}: not meaningful (baseline {r['baseline_score']:.3f} is within "
                           f"noise of chance {r['chance']:.3f})")
            continue
        line = (f"{task}{mark}: recovery {r['recovery_pct']:.1f}% [95% CI {r['ci_low']:.1f}, "
                f"{r['ci_high']:.1f}], {r['flips']}/{r['n']} flips")
        if r["ci_low"] < threshold:
            failed.append(f"{line}; lower end {r['ci_low']:.1f} < threshold {threshold:g}")
        else:
            passed.append(line)
    return Verdict(recipe, threshold, passed, failed, skipped)


def gate(baseline_name: str, recipe_names: list[str] | None = None,
         threshold: float | None = None) -> list[Verdict]:
    """Judge every named variant (default: every variant with an evaluation)."""
    root = evaluate.cache_root(baseline_name)
    if recipe_names is None:
        recipe_names = sorted(p.parent.name for p in root.glob(f"*/{evaluate.SUMMARY_FILE}"))
        if not recipe_names:
            raise ConfigError(f"no evaluation of a variant of {baseline_name} under {root}. Fix: "
                              "run `make eval` (or `make eval RECIPE=int4`) first.")
    verdicts = []
    for name in recipe_names:
        summary = read_json(root / name / evaluate.SUMMARY_FILE)
        if not summary.get("tasks"):
            raise ConfigError(f"variant {name!r} of {baseline_name} has not been evaluated "
                              f"({root / name / evaluate.SUMMARY_FILE} is missing). Fix: run "
                              f"`make eval RECIPE={name}` first.")
        limit = threshold_of(name, paths.variant_dir(baseline_name, name), threshold)
        verdicts.append(judge(summary, name, limit))
    return verdicts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=baselines.EMBEDDED_ALIASES[0],
                        help="embedded alias, local model directory or hub id (%(default)s)")
    parser.add_argument("--recipe", action="append",
                        help="variant to judge (repeatable; default: every evaluated variant)")
    parser.add_argument("--threshold", type=float,
                        help="override every recipe's recovery_threshold_pct (percent)")


def run(args: argparse.Namespace) -> int:
    name = baselines.resolve(args.baseline).name
    verdicts = gate(name, args.recipe, args.threshold)
    failures = []
    for v in verdicts:
        status = "PASS" if v.ok else "FAIL"
        print(f"[gate] {v.recipe}: {status} (threshold {v.threshold:g}% on the lower end of "
              "each 95% interval)")
        for line in v.passed:
            print(f"  ok    {line}")
        for line in v.failed:
            print(f"  FAIL  {line}")
        for line in v.skipped:
            print(f"  skip  {line}")
        if v.failed:
            failures += [f"{v.recipe}: {line}" for line in v.failed]
        elif not v.passed:
            failures.append(f"{v.recipe}: no task where the baseline is above chance, so recovery "
                            "cannot be judged; evaluate a suite where it is (e.g. SUITE=app)")
    if failures:
        raise GateFailed("recovery below threshold:\n  " + "\n  ".join(failures))
    return 0

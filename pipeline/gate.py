"""The recovery gate: a variant's recovery intervals must clear its recipe's threshold.

From the last ``qpipe eval`` (``artifacts/evals/<baseline>/<recipe>/recovery.json``), the 95%
interval of each suite's recovery (the mean of its tasks' recoveries; ``--level task``: each
task's own interval) is compared with the recipe's ``recovery_threshold_pct``:

- pass: the lower end clears the threshold;
- fail: even the upper end is below it, the variant is worse than allowed;
- inconclusive: the interval straddles it, too few items to tell. The gate does not pass it:
  add items to the suite (the interval narrows with the square root of their number) or lower
  the threshold knowingly.

The suite is the default unit because a ~100-item task alone gives an interval of about +-3
points, wider than a 99% threshold can be judged with; a suite pools its tasks' items. Tasks or
suites whose baseline is within noise of chance cannot pass or fail and are listed as such; a
variant with nothing meaningful fails.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import baseline as baselines
from pipeline import evaluate, paths, recipes
from pipeline.errors import ConfigError, QpipeError, RecipeError
from pipeline.fsutil import read_json

LEVELS = ("suite", "task")
PASS, FAIL, INCONCLUSIVE, NOT_EVALUATED = "pass", "fail", "inconclusive", "not evaluated"


class GateFailed(QpipeError):
    """A variant's recovery falls below its recipe's threshold."""

    exit_code = 1


@dataclass(frozen=True)
class Verdict:
    recipe: str
    threshold: float
    passed: list[str]  # one line per suite (or task)
    failed: list[str]
    skipped: list[str]  # not meaningful
    inconclusive: list[str] = field(default_factory=list)
    level: str = "suite"

    @property
    def ok(self) -> bool:
        return not self.failed and not self.inconclusive and bool(self.passed)

    @property
    def status(self) -> str:
        if self.failed:
            return FAIL
        return PASS if self.ok else INCONCLUSIVE

    def reason(self) -> str:
        """One line: why the variant did not pass (empty when it did)."""
        if self.failed:
            return "; ".join(self.failed)
        if self.inconclusive:
            return "; ".join(self.inconclusive)
        if not self.passed:
            return ("no suite or task where the baseline is above chance, so recovery cannot be "
                    "judged; evaluate a suite where it is (e.g. SUITE=app)")
        return ""


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


def _sort(line: str, low: float, high: float, threshold: float, out: dict[str, list[str]]
          ) -> None:
    if low >= threshold:
        out["passed"].append(line)
    elif high < threshold:
        out["failed"].append(f"{line}; upper end {high:.1f} < threshold {threshold:g}")
    else:
        out["inconclusive"].append(
            f"{line}; lower end {low:.1f} < threshold {threshold:g} <= upper end {high:.1f}: "
            "too few items to tell, add items to narrow the interval")


def _judge_tasks(summary: dict, threshold: float, out: dict[str, list[str]]) -> None:
    for task, entry in sorted(summary.get("tasks", {}).items()):
        r = entry["recovery"].get(entry["primary_metric"])
        if r is None:
            continue
        mark = " [emulated]" if entry.get("backend") == evaluate.EMULATED else ""
        if not r["meaningful"] or r["recovery_pct"] is None or r["ci_low"] is None:
            out["skipped"].append(
                f"{task}: not meaningful (baseline {r['baseline_score']:.3f} is within noise "
                f"of chance {r['chance']:.3f})")
            continue
        line = (f"{task}{mark}: recovery {r['recovery_pct']:.1f}% [95% CI {r['ci_low']:.1f}, "
                f"{r['ci_high']:.1f}], {r['flips']}/{r['n']} flips")
        _sort(line, r["ci_low"], r["ci_high"], threshold, out)


def _judge_suites(summary: dict, threshold: float, out: dict[str, list[str]]) -> None:
    tasks = summary.get("tasks", {})
    for suite, fig in sorted(summary.get("suites", {}).items()):
        if suite == "*":  # the mean over all suites: each suite is judged on its own
            continue
        mark = " [emulated]" if fig.get("backend") == evaluate.EMULATED else ""
        if fig.get("recovery_pct") is None or fig.get("ci_low") is None:
            out["skipped"].append(f"suite {suite}: not meaningful (no task above chance)")
            continue
        items = sum(next(iter(tasks[t]["recovery"].values()), {}).get("n", 0)
                    for t in fig["tasks"] if t in tasks)
        line = (f"suite {suite}{mark}: recovery {fig['recovery_pct']:.1f}% [95% CI "
                f"{fig['ci_low']:.1f}, {fig['ci_high']:.1f}] over {', '.join(fig['tasks'])} "
                f"({items} items)")
        _sort(line, fig["ci_low"], fig["ci_high"], threshold, out)


def judge(summary: dict, recipe: str, threshold: float, level: str = "suite") -> Verdict:
    """Compare each suite's (or task's) interval with ``threshold``."""
    if level not in LEVELS:
        raise ConfigError(f"gate level {level!r} is not one of {', '.join(LEVELS)}.")
    out: dict[str, list[str]] = {"passed": [], "failed": [], "inconclusive": [], "skipped": []}
    (_judge_suites if level == "suite" else _judge_tasks)(summary, threshold, out)
    return Verdict(recipe, threshold, out["passed"], out["failed"], out["skipped"],
                   out["inconclusive"], level)


def gate(baseline_name: str, recipe_names: list[str] | None = None,
         threshold: float | None = None, level: str = "suite") -> list[Verdict]:
    """Judge every named variant (default: every variant with an evaluation)."""
    root = evaluate.cache_root(baseline_name)
    if recipe_names is None:
        recipe_names = sorted(p.parent.name for p in root.glob(f"*/{evaluate.SUMMARY_FILE}"))
        if not recipe_names:
            raise ConfigError(f"no evaluation of a variant of {baseline_name} under {root}. Fix: "
                              "run `make eval` (or `make eval RECIPE=int4`) first.")
    verdicts = []
    for name in recipe_names:
        failure = read_json(root / name / evaluate.FAILURE_FILE)
        if failure:  # the last scoring of this variant failed: nothing current to judge
            limit = threshold_of(name, paths.variant_dir(baseline_name, name), threshold)
            verdicts.append(Verdict(name, limit, [], [f"its last evaluation failed: "
                                                      f"{failure.get('reason', '?')}"], [],
                                    level=level))
            continue
        summary = read_json(root / name / evaluate.SUMMARY_FILE)
        if not summary.get("tasks"):
            raise ConfigError(f"variant {name!r} of {baseline_name} has not been evaluated "
                              f"({root / name / evaluate.SUMMARY_FILE} is missing). Fix: run "
                              f"`make eval RECIPE={name}` first.")
        limit = threshold_of(name, paths.variant_dir(baseline_name, name), threshold)
        verdicts.append(judge(summary, name, limit, level))
    return verdicts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    baselines.add_baseline_argument(parser)
    parser.add_argument("--recipe", action="append",
                        help="variant to judge (repeatable; default: every evaluated variant)")
    parser.add_argument("--threshold", type=float,
                        help="override every recipe's recovery_threshold_pct (percent)")
    parser.add_argument("--level", choices=LEVELS, default="suite",
                        help="judge each suite's interval (default) or each task's")


def run(args: argparse.Namespace) -> int:
    name = baselines.resolve(args.baseline).name
    level = getattr(args, "level", "suite")
    verdicts = gate(name, args.recipe, args.threshold, level)
    failures = []
    for v in verdicts:
        print(f"[gate] {v.recipe}: {v.status.upper()} (threshold {v.threshold:g}% on the lower "
              f"end of each {level}'s 95% interval)")
        for mark, lines in (("ok   ", v.passed), ("FAIL ", v.failed), ("?    ", v.inconclusive),
                            ("skip ", v.skipped)):
            for line in lines:
                print(f"  {mark} {line}")
        if v.failed or v.inconclusive:
            failures += [f"{v.recipe}: {line}" for line in v.failed + v.inconclusive]
        elif not v.passed:
            failures.append(f"{v.recipe}: {v.reason()}")
    if failures:
        raise GateFailed("recovery not shown to clear the threshold:\n  " + "\n  ".join(failures))
    return 0

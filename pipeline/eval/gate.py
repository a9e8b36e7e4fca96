"""The recovery gate: a variant passes only where its evidence certifies its recipe's threshold.

From the last ``qpipe eval`` (``artifacts/evals/<baseline>/<recipe>/recovery.json``), only the
task results that are current count: scored on this very checkpoint, against this baseline,
with the task file and data as they are now (anything else is listed as stale, never judged).
Each suite's figure is the mean of its meaningful tasks' recoveries with a MOVER interval
(:mod:`pipeline.recovery`), computed here from those task results; ``--level task`` judges each
task's own interval. Against the recipe's ``recovery_threshold_pct``:

- pass: the lower end of the 95% interval clears the threshold, and, for a suite, no
  meaningful task measures below the threshold with more items lost than gained: other tasks'
  gains cannot hide one task's loss (in the simulation of a task truly 7.5% down beside two
  that gain, this catches it most of the time; requiring a loss shown by McNemar's test caught
  it only half the time: ``make calibrate``);
- fail: the upper end (of the suite, or of any meaningful task in it) is below the threshold;
- inconclusive: the interval straddles the threshold, or a suite whose mean clears it holds a
  task measured below it with a net loss. The verdict says how many items were judged and the best
  recovery they can certify for a variant that answers every item as the baseline does ("131
  items can certify at best 96.9%"); when that is below the threshold it says about how many
  items would certify it (for a suite, averaged over its tasks as the suite is);
- not meaningful: no task of the suite (or the variant) has a baseline clear of chance, so
  there is nothing to judge.

A variant passes when every meaningful suite passes; it fails when one fails; it is not
meaningful when no suite is. ``make gate`` exits 0 only when every variant judged passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core import log as qlog
from pipeline.core.artifacts import (
    EMULATED,
    SERVED,
    Baseline,
    EvalFailure,
    Manifest,
    Recovery,
    RecoverySummary,
    SuiteFigure,
    TaskEntry,
    manifests,
)
from pipeline.core.errors import ConfigError, QpipeError
from pipeline.eval import recovery, suites
from pipeline.eval.settings import LEVELS, GateSettings

log = qlog.get("gate")

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
NOT_MEANINGFUL, NOT_EVALUATED = "not meaningful", "not evaluated"


class GateFailed(QpipeError):
    """A variant's recovery is not shown to clear its recipe's threshold."""

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
    stale: list[str] = field(default_factory=list)  # results not judged, and why

    @property
    def ok(self) -> bool:
        return self.status == PASS

    @property
    def status(self) -> str:
        if self.failed:
            return FAIL
        if self.inconclusive:
            return INCONCLUSIVE
        return PASS if self.passed else (NOT_MEANINGFUL if self.skipped else NOT_EVALUATED)

    def reason(self) -> str:
        """One line: why the variant did not pass (empty when it did)."""
        if self.failed:
            return "; ".join(self.failed)
        if self.inconclusive:
            return "; ".join(self.inconclusive)
        if self.skipped and not self.passed:
            return ("no suite or task where the baseline is above chance, so recovery cannot be "
                    "judged; evaluate a suite where it is (e.g. SUITE=app)")
        if not self.passed:
            why = f" ({'; '.join(self.stale)})" if self.stale else ""
            return f"no current evaluation{why}: run `make eval RECIPE={self.recipe}`"
        return ""


def threshold_of(manifest: Manifest, recipe: str, override: float | None = None) -> float:
    """``--threshold``, else the threshold the variant was quantized for (its manifest's copy
    of the recipe's ``recovery_threshold_pct``: a recipe edited since does not move it)."""
    if override is not None:
        return override
    if manifest.recipe.recovery_threshold_pct is not None:
        return manifest.recipe.recovery_threshold_pct
    raise ConfigError(
        f"variant {recipe!r} was quantized from a recipe with no qpipe.recovery_threshold_pct "
        f"(its {Manifest.FILE} records none). Fix: add `recovery_threshold_pct: 96` under "
        f"`qpipe:` in the recipe and `make quantize RECIPE={recipe}` (it re-uses the "
        "checkpoint), or pass --threshold.")


# --- what is current ----------------------------------------------------------------------------
def _task_shas() -> dict[str, str]:
    return {t.name: t.sha256 for ts in suites.discover().values() for t in ts}


Entries = dict[str, TaskEntry]


def current_tasks(summary: RecoverySummary | None, identity: str,
                  baseline_identity: str | None = None) -> tuple[Entries, list[str]]:
    """(task -> entry) of the results scored on this checkpoint, against this baseline, with the
    task as it is now; and one line per result left out, saying why."""
    shas = _task_shas()
    current, stale = {}, []
    for name, entry in sorted((summary.tasks if summary else {}).items()):
        if entry.identity != identity:
            stale.append(f"{name}: scored on another checkpoint of this variant")
        elif baseline_identity and entry.baseline_identity != baseline_identity:
            stale.append(f"{name}: scored against another baseline")
        elif entry.task_sha != (shas.get(name) or suites.builtin_task_sha(name)):
            stale.append(f"{name}: its task file or data changed since it was scored")
        else:
            current[name] = entry
    return current, stale


def suite_figures(entries: Entries) -> dict[str, SuiteFigure]:
    """Suite -> its figure, from current task entries."""
    groups: dict[str, Entries] = {}
    for name, entry in entries.items():
        if entry.primary() is not None:
            groups.setdefault(entry.suite, {})[name] = entry
    out = {}
    for suite, members in sorted(groups.items()):
        fig = recovery.suite_from_tasks({n: _primary(e) for n, e in members.items()})
        fig.backend = EMULATED if any(e.backend == EMULATED for e in members.values()) else SERVED
        out[suite] = fig
    return out


# --- judging ------------------------------------------------------------------------------------
def _certify(items: int, best: float | None, threshold: float,
             tasks: list[tuple[int, float]]) -> str:
    """What these items can show at best: the lower end if the variant answered every item as
    the baseline did (only gains can lift a result above it). ``tasks``: (items, baseline
    score) of each task averaged, for the items that would certify the threshold."""
    if best is None:
        return ""
    if best < threshold:
        need = (recovery.items_needed(threshold, tasks[0][1]) if len(tasks) == 1 else
                recovery.suite_items_needed(tasks, threshold)) if tasks else None
        more = f"; about {need:,} items would" if need else ""
        return (f"; {items} items can certify at best {best:.1f}% (a variant answering every "
                f"item as the baseline does), below the threshold{more}, or lower the "
                "threshold knowingly")
    return (f"; {items} items can certify up to {best:.1f}%: too few to tell at this many "
            "flips, add items to narrow the interval")


def _sort(line: str, low: float, high: float, threshold: float, out: dict[str, list[str]],
          certify: str) -> None:
    if low >= threshold:
        out["passed"].append(line)
    elif high < threshold:
        out["failed"].append(f"{line}; upper end {high:.1f} < threshold {threshold:g}")
    else:
        out["inconclusive"].append(
            f"{line}; lower end {low:.1f} < threshold {threshold:g} <= upper end {high:.1f}"
            + certify)


def _mark(backend: str | None) -> str:
    return " [emulated]" if backend == EMULATED else ""


def _primary(entry: TaskEntry) -> Recovery:
    """The recovery of a task the suite's figure counted (it has one)."""
    found = entry.primary()
    assert found is not None
    return found


def _judge_tasks(entries: Entries, threshold: float,
                 out: dict[str, list[str]]) -> None:
    for task, entry in sorted(entries.items()):
        r = entry.primary()
        if r is None:
            continue
        if not r.meaningful or r.recovery_pct is None or r.ci_low is None or r.ci_high is None:
            out["skipped"].append(
                f"{task}: not meaningful (baseline {r.baseline_score:.3f} is within noise "
                f"of chance {r.chance:.3f})")
            continue
        skill = r.above_chance_pct
        above = f" (above chance: {skill:.1f}%)" if skill is not None else ""
        line = (f"{task}{_mark(entry.backend)}: recovery {r.recovery_pct:.1f}% "
                f"[95% CI {r.ci_low:.1f}, {r.ci_high:.1f}]{above}, {r.flips}/{r.n} flips")
        _sort(line, r.ci_low, r.ci_high, threshold, out,
              _certify(r.n, r.certifiable_pct, threshold, [(r.n, r.baseline_score)]))


def _judge_suites(entries: Entries, threshold: float,
                  out: dict[str, list[str]]) -> None:
    for suite, fig in suite_figures(entries).items():
        mark = _mark(fig.backend)
        if fig.recovery_pct is None or fig.ci_low is None or fig.ci_high is None:
            out["skipped"].append(f"suite {suite}{mark}: not meaningful (no task above chance)")
            continue
        line = (f"suite {suite}{mark}: recovery {fig.recovery_pct:.1f}% [95% CI "
                f"{fig.ci_low:.1f}, {fig.ci_high:.1f}] over {', '.join(fig.tasks)} "
                f"({fig.items} items)")
        scores = {t: _primary(entries[t]) for t in fig.tasks}  # each with its figures
        sinking = [t for t, r in scores.items() if (r.ci_high or 0.0) < threshold]
        if sinking:
            lows = ", ".join(f"{t} {scores[t].recovery_pct:.1f}% [upper end "
                             f"{scores[t].ci_high:.1f}]" for t in sinking)
            lost = any((scores[t].recovery_pct or 0.0) < 100 for t in sinking)
            why = ("one task's loss is not averaged away by the others" if lost else
                   "no task lost anything, but a threshold above 100% asks the variant to beat "
                   "the baseline, and this task is shown not to")
            out["failed"].append(f"{line}; task {lows} < threshold {threshold:g}: {why}")
            continue
        shares = [(r.n, r.baseline_score) for r in scores.values()]
        certify = _certify(fig.items, fig.certifiable_pct, threshold, shares)
        hidden = [t for t, r in scores.items()
                  if (r.recovery_pct or 0.0) < threshold and r.lost > r.gained]
        if hidden and fig.ci_low >= threshold:
            losses = ", ".join(f"{t} {scores[t].recovery_pct:.1f}% ({scores[t].lost} lost, "
                               f"{scores[t].gained} gained)" for t in hidden)
            out["inconclusive"].append(
                f"{line}; the suite's mean clears {threshold:g}, but task {losses} measures "
                "below the threshold, with more items lost than gained: the other tasks' gains "
                "do not pass it (more items on that task, or GATE_LEVEL=task, settle it)")
            continue
        _sort(line, fig.ci_low, fig.ci_high, threshold, out, certify)


def judge(entries: Entries, recipe: str, threshold: float,
          level: str = "suite", stale: list[str] | None = None) -> Verdict:
    """Compare each suite's (or task's) interval of the current ``entries`` with ``threshold``."""
    if level not in LEVELS:
        raise ConfigError(f"gate level {level!r} is not one of {', '.join(LEVELS)}.")
    out: dict[str, list[str]] = {"passed": [], "failed": [], "inconclusive": [], "skipped": []}
    (_judge_suites if level == "suite" else _judge_tasks)(entries, threshold, out)
    return Verdict(recipe, threshold, out["passed"], out["failed"], out["skipped"],
                   out["inconclusive"], level, list(stale or []))


def judge_variant(baseline: Baseline, recipe: str, threshold: float | None = None,
                  level: str = "suite") -> Verdict:
    """The verdict on one variant's current evaluation (a failed last evaluation fails)."""
    manifest = manifests(baseline.name, [recipe])[recipe]
    limit, identity = threshold_of(manifest, recipe, threshold), manifest.cache_key
    failure = EvalFailure.load(baseline.name, recipe)
    if failure is not None and failure.identity == identity:
        return Verdict(recipe, limit, [], [f"its last evaluation failed: {failure.reason}"], [],
                       level=level)
    entries, stale = current_tasks(RecoverySummary.load(baseline.name, recipe), identity,
                                   baseline.identity)
    return judge(entries, recipe, limit, level, stale)


def gate(baseline: Baseline, recipe_names: list[str] | None = None,
         threshold: float | None = None, level: str = "suite") -> list[Verdict]:
    """Judge every named variant (default: every variant with an evaluation)."""
    root = RecoverySummary.root(baseline.name)
    if not recipe_names:
        recipe_names = sorted(p.parent.name for p in root.glob(f"*/{RecoverySummary.FILE}"))
        if not recipe_names:
            raise ConfigError(f"no evaluation of a variant of {baseline.name} under {root}. Fix: "
                              "run `make eval` (or `make eval RECIPE=int4`) first.")
    for name in recipe_names:
        if not RecoverySummary.path(baseline.name, name).is_file() and not \
                EvalFailure.path(baseline.name, name).is_file():
            raise ConfigError(f"variant {name!r} of {baseline.name} has not been evaluated "
                              f"({RecoverySummary.path(baseline.name, name)} is missing). Fix: "
                              f"run `make eval RECIPE={name}` first.")
    return [judge_variant(baseline, name, threshold, level) for name in recipe_names]


def run(settings: GateSettings) -> list[Verdict]:
    """``qpipe gate`` / ``make gate``: raises GateFailed (exit 1) unless every variant passes."""
    from pipeline.quantize.baseline import resolve

    base = resolve(settings.baseline)
    level = settings.level
    verdicts = gate(base, list(settings.recipes) or None, settings.threshold, level)
    failures = []
    for v in verdicts:
        log.info(f"{v.recipe}: {v.status.upper()} (threshold {v.threshold:g}% on the lower "
                 f"end of each {level}'s 95% interval)")
        for mark, lines in (("ok   ", v.passed), ("FAIL ", v.failed), ("?    ", v.inconclusive),
                            ("skip ", v.skipped), ("stale", v.stale)):
            for line in lines:
                print(f"  {mark} {line}")
        if not v.ok:
            failures.append(f"{v.recipe} ({v.status}): {v.reason()}")
    if failures:
        raise GateFailed("recovery not shown to clear the threshold:\n  " + "\n  ".join(failures))
    return verdicts

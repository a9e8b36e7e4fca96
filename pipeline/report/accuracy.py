"""What each variant keeps of the baseline: its current task results and the gate's verdict,
and, beside them, what the precision search predicted its damage to be."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.core import formats
from pipeline.core.artifacts import (
    EMULATED,
    SERVED,
    Baseline,
    Manifest,
    Prediction,
    RecoverySummary,
    Row,
    SensitivityTable,
)
from pipeline.eval import gate


def apply_eval(row: Row, summary: RecoverySummary, base: Baseline, identity: str,
               manifest: Manifest, threshold: float | None = None) -> None:
    """The variant's current task results (this checkpoint, baseline and task files), its
    suite figures and the gate's verdict on them at ``threshold`` (else its recipe's, as its
    ``manifest`` records it); stale results are named, never used."""
    entries, stale = gate.current_tasks(summary, identity, base.identity)
    row.tasks = entries
    row.suites = gate.suite_figures(entries)
    backends = {t.backend for t in entries.values()}
    row.eval_backend = EMULATED if EMULATED in backends else (SERVED if backends else None)
    div = summary.divergence or {}
    if div.get("identity") == identity:
        row.divergence = {k: v for k, v in div.items() if isinstance(v, (int, float))}
    row.threshold = gate.threshold_of(manifest, row.recipe, threshold)
    row.threshold_from = "recipe" if threshold is None else "campaign"
    own = manifest.recipe.recovery_threshold_pct
    if threshold is not None and threshold != own:
        row.notes.append(f"gate threshold {threshold:g}%: the campaign's, instead of recipe "
                         f"{row.recipe}'s own {f'{own:g}%' if own is not None else 'none'} "
                         "(THRESHOLD= or the campaign file's threshold:)")
    verdict = gate.judge(entries, row.recipe, row.threshold, stale=stale)
    row.gate_status, row.gate_reason = verdict.status, verdict.reason()
    if stale:
        row.notes.append("eval: not judged, stale: " + "; ".join(stale)
                         + f" (make eval RECIPE={row.name})")


def sensitivity_tables(base: Baseline) -> list[SensitivityTable]:
    """This baseline's sensitivity tables, newest first."""
    found = []
    for path in SensitivityTable.root(base.name).glob(f"*/{SensitivityTable.FILE}"):
        table = SensitivityTable.read(path)
        if table is not None and table.baseline.get("identity") == base.identity:
            found.append((path.stat().st_mtime, table))
    return [t for _, t in sorted(found, key=lambda x: -x[0])]


def apply_search(row: Row, found: Mapping[str, Any], tables: list[SensitivityTable]) -> None:
    """What the sensitivity model predicted for this variant: a searched recipe's own
    prediction (``found``: its ``qpipe.search``, as its manifest records it), or, for a uniform
    int4/int8 recipe, the table with every unit in its format."""
    if "predicted_damage" in found:
        row.search = Prediction(predicted_kl=float(found["predicted_damage"]),
                                predicted_weight_bytes=int(found.get("weight_bytes") or 0),
                                basis=f"searched: {found.get('how', '?')}",
                                predicted_speedup=found.get("predicted_speedup"),
                                predicted_speedup_low=found.get("predicted_speedup_low"),
                                predicted_speedup_high=found.get("predicted_speedup_high"))
        if found.get("target") not in (None, "here"):
            row.notes.append(f"searched for {found.get('target_described') or found['target']}"
                             ": its menu is that machine's; where this machine does not serve "
                             "a format it holds, it is reported unsupported and scored "
                             "emulated; where it does serve them, the speed and capacity "
                             "shown are this machine's, not the target's")
        return
    fmt = formats.scanned_as(row.precision, row.group_size, row.symmetric)
    table = next((t for t in tables if fmt in t.formats), None)
    if table is not None and fmt is not None:
        size, damage = table.uniform(fmt)
        row.search = Prediction(predicted_kl=damage, predicted_weight_bytes=size,
                                basis=f"every unit at {fmt} in the sensitivity table "
                                      "(round-to-nearest)", uniform=True)

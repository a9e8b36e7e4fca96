"""Which bench run a comparison's speed comes from, and each row's figures from it: one
reference run (one baseline run, workload and load point) for every comparable row; runs on
other hardware are never comparable; capacity searches made in other runs, at one objective."""

from __future__ import annotations

from pathlib import Path

from pipeline.bench.reference_dtype import FLOAT32
from pipeline.core.artifacts import (
    BenchSummary,
    Capacity,
    CostTarget,
    ModelBench,
    PointFigures,
    Row,
)
from pipeline.core.variant import BASELINE
from pipeline.report import cost, crossover


def holds(summary: BenchSummary, name: str, identity: str) -> ModelBench | None:
    entry = summary.models.get(name)
    return entry if entry is not None and entry.identity == identity else None


def own_dtype_speedup(ref: BenchSummary | None) -> dict[str, float]:
    """The baseline in the checkpoints' own dtype against a reference served in another (the
    bench's probe of float32 against bf16 on a CPU without bf16 units, inverted): the speed a
    variant's unquantized layers run at; {} where the reference is the checkpoints' dtype."""
    if ref is None or ref.reference.get("dtype") != FLOAT32:
        return {}
    probe = (ref.reference.get("probe") or {}).get("float32_vs_bf16") or {}
    point = probe.get("point")
    if not point:
        return {}
    return {"point": round(1 / point, 4), "low": round(1 / (probe.get("high") or point), 4),
            "high": round(1 / (probe.get("low") or point), 4)}


def reference_run(summaries: list[tuple[Path, BenchSummary]], identities: dict[str, str],
                  hardware_key: str) -> tuple[Path, BenchSummary] | None:
    """The bench run the comparison is made from: of the runs that served this baseline, the
    one on this machine's hardware that measured most of the current variants, with a speed
    sweep rather than only a capacity search (the newest on a tie). Every speedup compared
    comes from it: one baseline run, one workload, one load point."""
    ranked = []  # this machine's hardware first: rows measured on another never compare with it
    for age, (path, summary) in enumerate(summaries):  # newest first
        base = holds(summary, BASELINE, identities[BASELINE])
        if base is None or base.status != "ok":
            continue
        covered = sum(holds(summary, n, i) is not None for n, i in identities.items())
        same_hw = summary.hardware.get("key") == hardware_key
        swept = any(summary.headline.values())  # a search-only run has no headline point
        ranked.append(((same_hw, covered, swept, -age), path, summary))
    if not ranked:
        return None
    _, path, summary = max(ranked, key=lambda r: r[0])
    return path, summary


REFERENCE, PAIRED = "reference", "paired"


def compared_as(summary: BenchSummary, in_reference: bool, baseline_identity: str,
                measured_on: str, per_variant: bool) -> str:
    """How a row measured in ``summary`` compares: ``reference`` (in the reference run),
    ``paired`` (beside its own baseline server on the reference's hardware, a campaign on
    Ray), else why it is not comparable. A run on other hardware never is."""
    if in_reference:
        return REFERENCE
    key = summary.hardware.get("key", "unknown")
    if key != measured_on:
        return (f"measured on other hardware ({summary.hardware.get('summary', key)}) than the "
                f"comparison's reference run ({measured_on})")
    if per_variant and holds(summary, BASELINE, baseline_identity) is not None:
        return PAIRED
    return ("another measurement than the comparison's reference run: its speedup is against "
            "another baseline run (`make bench` measures every variant in one run)")


def capacity_of(entry: ModelBench, by: str = "concurrency") -> Capacity | None:
    """A model's first capacity search over ``by`` (concurrency, or the arrival rate), with
    the bounded latencies at each point it visited."""
    for name, figures in entry.workloads.items():
        found = figures.capacity
        if found is not None and found.search_by == by:
            return found.model_copy(update={"workload": name, "curve": {
                c: {k: at.metrics[k] for k in found.bounds if k in at.metrics}
                for c, at in figures.points.items()}})
    return None


def newest_capacity(row: Row, identity: str, summaries: list[tuple[Path, BenchSummary]],
                    hardware_key: str, target: CostTarget) -> None:
    """A capacity search made in another run on the compared hardware (``make bench
    WORKLOAD=capacity``): an absolute figure, shown with the run it comes from and priced on
    the devices that run used (its own price, not the speed run's)."""
    for by, field in (("concurrency", "capacity"), ("rate", "rate_capacity")):
        if getattr(row, field):
            continue
        for path, summary in summaries:  # newest first
            entry = holds(summary, row.name, identity)
            found = capacity_of(entry, by) if entry is not None and entry.status == "ok" \
                else None
            if found is not None and summary.hardware.get("key") == hardware_key:
                label = measurement_label(path, summary)
                price = cost.price_of(target, cost.devices_of(summary))
                setattr(row, field, found.model_copy(update={"measurement": label,
                                                             "price": price}))
                row.notes.append(f"capacity at the objective ({by}) from {label}")
                break


def one_objective(rows: list[Row], field: str = "capacity") -> None:
    """Capacities (``field``: ``capacity`` or ``rate_capacity``) are compared at one objective
    and workload: the baseline's (else the first row's). A row searched at another is shown as
    such and gets no cost to rank."""
    searched = [(r, cap) for r in rows if (cap := getattr(r, field)) is not None]
    base = next((cap for r, cap in searched if r.name == BASELINE),
                searched[0][1] if searched else None)
    if base is None:
        return
    basis = (base.workload, base.objective)
    for row, cap in searched:
        other = (cap.workload, cap.objective)
        if other != basis:
            setattr(row, field, cap.model_copy(update={"other_objective": True}))
            row.notes.append(f"capacity searched at {other[1]} (workload {other[0]}), not at the "
                             f"comparison's {basis[1]} (workload {basis[0]}): shown, not ranked "
                             "or priced against the others")


def traffic(summaries: list[tuple[Path, BenchSummary]], identity: str
             ) -> dict[str, dict[str, float]]:
    """Each prompt-file or trace workload's requests as sent: the newest run of each."""
    out: dict[str, dict[str, float]] = {}
    for _, summary in summaries:  # newest first
        base = holds(summary, BASELINE, identity)
        for name, figures in (base.workloads.items() if base is not None else ()):
            if figures.lengths and name not in out:
                out[name] = figures.lengths
    return out


def measured_in(name: str, identity: str, summaries: list[tuple[Path, BenchSummary]]
                 ) -> tuple[Path, BenchSummary, ModelBench] | None:
    for path, summary in summaries:
        entry = holds(summary, name, identity)
        if entry is not None:
            return path, summary, entry
    return None


def measurement_label(path: Path, summary: BenchSummary) -> str:
    return f"bench {path.parent.name}" + (f" ({summary.measured})" if summary.measured else "")


def apply_bench(row: Row, summary: BenchSummary, entry: ModelBench) -> tuple[str, int]:
    """Fill the bench fields; returns (headline workload, its load point)."""
    workloads = [Path(w).stem for w in summary.workloads] or list(entry.workloads)
    # the headline: the first sweep (a capacity search has no load points of its own)
    first = next((w for w in workloads if summary.headline.get(w)), workloads[0])
    head = summary.headline.get(first) or None
    row.serving, row.serving_reason, row.serving_log = entry.status, entry.reason, entry.log
    row.kv, row.engine = dict(entry.kv), entry.engine
    if row.engine.plan_note:
        row.notes.append(f"bench: {row.engine.plan_note}")
    if row.engine.plan_check:
        row.notes.append(f"bench: {row.engine.plan_check}")
    if row.engine.fp8_weight_only:
        row.notes.append(f"served as {row.engine.scheme}: its speed is not an FP8 W8A8 speed")
    if row.engine.kernels_by_layer_text:
        row.notes.append(f"served on {row.engine.kernels_by_layer_text}")
    row.peak_memory_bytes = entry.peak_memory_bytes
    data = entry.workloads.get(first)
    row.sweep = dict(data.points) if data else {}
    if head is None and row.sweep:
        head = sorted(row.sweep)[len(row.sweep) // 2]
    row.headline = (row.sweep.get(head) if head is not None else None) or PointFigures()
    if row.name != BASELINE:
        row.crossover = crossover.sentence(row.sweep)
    row.capacity = capacity_of(entry)
    row.rate_capacity = capacity_of(entry, "rate")
    for name in (w for w in workloads if w != first):
        other = entry.workloads.get(name)
        if other is not None and other.prefix_cache_ttft_speedup is not None:
            row.prefix = {k: v for k, v in other.counters().items()
                          if k in ("prefix_cache_hit_rate", "prefix_cache_expected_hit_rate",
                                   "prefix_cache_ttft_speedup")}
    return first, head or 0

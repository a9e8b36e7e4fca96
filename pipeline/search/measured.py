"""What the newest comparison of a baseline measured that the search learns from: each
uniform variant's measured/predicted KL (a per-format calibration of the round-to-nearest
scan against GPTQ checkpoints), each uniform variant's measured speedup (a speed budget's
prediction), and how the search's predictions held."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.core import formats
from pipeline.core.artifacts import Comparison, Prediction, Row, SensitivityTable
from pipeline.search.recipe import KEEP
from pipeline.search.solver import Option

if TYPE_CHECKING:
    from pipeline.search.menu import Target


def _uniform(row: Row, table: SensitivityTable) -> str | None:
    """The menu format a comparison row's checkpoint is in every unit, quantized as the scan
    quantizes it (its recorded format, group and zero points; not its recipe's name), else
    None."""
    fmt = formats.scanned_as(row.precision, row.group_size, row.symmetric)
    return fmt if fmt in table.formats and fmt != KEEP else None


@dataclass(frozen=True)
class Speed:
    """A uniform variant's measured speedup over the baseline, with its interval (the point
    itself where the comparison recorded none)."""

    point: float
    low: float
    high: float

    def text(self) -> str:
        return f"{self.point:.2f}x [{self.low:.2f}, {self.high:.2f}]"


def _newest(table_or_name: SensitivityTable | str) -> Comparison | None:
    name = table_or_name if isinstance(table_or_name, str) else \
        table_or_name.baseline.get("name", "")
    return Comparison.read(Comparison.directory(name) / Comparison.FILE) if name else None


def speeds(table: SensitivityTable, target: Target | None = None
           ) -> tuple[dict[str, Speed], str]:
    """Per format, the uniform variant's measured speedup over the baseline at the newest
    comparison's headline load point, with its interval (on the engine that served it; bf16
    is 1, or the baseline's own dtype against a float32 reference), and where from. A format
    no comparison served is not in it; none is where the comparison was not measured on a
    machine of ``target``'s kind (its speeds are another machine's)."""
    comparison = _newest(table)
    if comparison is None:
        return {}, "no comparison of this baseline yet (make all RECIPE=\"int4 int8\")"
    key = comparison.measurement.get("hardware_key", "")
    if target is not None and not target.measures(key):
        where = key or "a machine it does not record (make compare records it)"
        return {}, (f"the newest comparison was measured on {where} "
                    f"({comparison.hardware or 'not described'}), not on "
                    f"{target.described}, and a speed budget holds only on the machine its "
                    "speeds were measured on")
    # a unit kept unquantized runs in the checkpoint's own dtype: the reference's speed,
    # unless the reference is served in another (float32 on a CPU without bf16 units)
    own = comparison.own_dtype_speedup
    found = {KEEP: Speed(own["point"], own["low"], own["high"]) if own else Speed(1.0, 1.0, 1.0)}
    for row in comparison.rows:
        fmt = _uniform(row, table)
        if fmt is not None and row.comparable and row.serving == "ok" \
                and (measured := row.headline.speedup):
            point = round(measured.point, 4)
            low = measured.low or point
            high = measured.high or point
            found.setdefault(fmt, Speed(point, round(min(low, point), 4),
                                        round(max(high, point), 4)))
    when = comparison.meta.get("created", "")
    where = comparison.hardware or "the machine that ran it"
    return found, (f"the uniform variants' measured speedups at {comparison.workload} "
                   f"concurrency {comparison.load_point} in the newest comparison"
                   f"{f' ({when})' if when else ''}, on {where}: "
                   + ", ".join(f"{f} {x.text()}" for f, x in found.items() if f != KEEP)
                   + (f"; {KEEP} units at {found[KEEP].text()}, the baseline in its own dtype "
                      "against the reference served in float32" if own else ""))


def _shares(table: SensitivityTable) -> dict[str, float]:
    """Each unit's share of the linear layers' bf16 weights: its share of their serving time."""
    total = sum(table.damage(u, KEEP).bytes for u in table.units)
    return {u: table.damage(u, KEEP).bytes / total for u in table.units}


def mix_speedup(formats: dict[str, str], table: SensitivityTable,
                speed: dict[str, Speed]) -> Speed:
    """A mix's predicted speedup from the uniform variants' (:func:`timed`'s model), at their
    points and at their intervals' ends: every format at its low end gives the low end."""
    shares = _shares(table)

    def at(pick: str) -> float:
        return 1 / sum(shares[u] / getattr(speed[f], pick) for u, f in formats.items())
    return Speed(round(at("point"), 4), round(at("low"), 4), round(at("high"), 4))



def timed(opts: dict[str, list[Option]], table: SensitivityTable,
          speed: dict[str, float]) -> dict[str, list[Option]]:
    """The options with their predicted share of the baseline's serving time: a unit's share
    of the linear layers' weights over its format's measured uniform speedup (serving time
    as a fixed part plus the linear layers', each in proportion to its weights: exact for
    every uniform variant); formats with no measured speedup left out."""
    shares = _shares(table)
    return {unit: [Option(o.format, o.bytes, o.damage, shares[unit] / speed[o.format])
                   for o in unit_opts if o.format in speed] for unit, unit_opts in opts.items()}



def calibration(table: SensitivityTable) -> tuple[dict[str, float], str]:
    """Per format, the uniform variant's measured over predicted KL in the newest comparison
    of this baseline: the scan is round-to-nearest, the checkpoints GPTQ, and the measured
    whole-model damage of every unit in one format says how far the summed per-unit damages
    are off for it. ({} and why, where none is measured: the damages are then used as
    scanned.)"""
    comparison = _newest(table)
    if comparison is None:
        return {}, "not calibrated: no comparison of this baseline yet"
    factors = {}
    for row in comparison.rows:
        if (fmt := _uniform(row, table)) is not None:
            # the table's own prediction: the comparison may predate the table (a scan run
            # after `make all`), and then holds no prediction for its uniform variants
            _, predicted = table.uniform(fmt)
            found = Prediction(predicted_kl=predicted, basis="uniform").ratio(
                row.divergence.get("kl_div_mean"))
            if found is not None:
                factors.setdefault(fmt, round(found, 4))
    if not factors:
        return {}, "not calibrated: no uniform variant of the menu measured in the newest " \
            "comparison (make all RECIPE=\"int4 int8\")"
    when = comparison.meta.get("created", "")
    others = [f for f in table.formats if f not in factors and f != KEEP]
    return factors, ("each format's damages times its uniform variant's measured/predicted KL "
                     f"in the newest comparison{f' ({when})' if when else ''}: "
                     + ", ".join(f"{f} {x:.2f}x" for f, x in factors.items())
                     + (f"; {', '.join(others)} as scanned (not measured)" if others else ""))



def predictions_held(baseline_name: str) -> str:
    """How the search's predictions held in the newest comparison of this baseline: each
    searched variant with a measured KL, measured over predicted ("" if none)."""
    comparison = _newest(baseline_name)
    if comparison is None:
        return ""
    # searched variants only: a shipped uniform recipe is quantized by its own method
    found = [(row.name, ratio, row.search.held(row.divergence.get("kl_div_mean")))
             for row in comparison.rows if row.search is not None and not row.search.uniform
             and (ratio := row.search.ratio(row.divergence.get("kl_div_mean"))) is not None]
    if not found:
        return ""
    low, high = Prediction.HELD
    held = sum(1 for *_, ok in found if ok)
    when = comparison.meta.get("created", "")
    return (f"{held} of {len(found)} predictions held (measured within {low:g}-{high:g}x of "
            f"predicted, or within {Prediction.FLOOR:g} nats/token) in the newest comparison"
            f"{f' ({when})' if when else ''}: "
            + ", ".join(f"{name} {ratio:.2f}x" for name, ratio, _ in found))

"""The choice of one format per unit: an integer program, solved exactly (scipy's ``milp``).

Each unit (a group of layers vLLM runs as one GEMM, or one layer) takes exactly one format of
its options; each option has a weight size and a damage (its KL divergence when that unit
alone is quantized). The damage of a whole choice is predicted as the sum of its units'
(additivity: an assumption, checked against the measured damage of the resulting model).
Two questions: the least damage within a byte budget, or the fewest bytes within a damage
budget. A budget no choice meets is an error naming the tightest budget that is met.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.core.errors import ConfigError


@dataclass(frozen=True)
class Option:
    """One format for one unit: its weight bytes, its measured damage and, for a speed
    budget, its predicted share of the baseline's serving time."""

    format: str
    bytes: int
    damage: float
    time: float = 0.0


@dataclass(frozen=True)
class Choice:
    """The solver's answer: unit -> format, and its totals."""

    formats: dict[str, str]
    bytes: int
    damage: float  # predicted: the sum of the units' damages
    time: float = 0.0  # predicted serving time over the baseline's (1 / speedup)


def _check(options: dict[str, list[Option]]) -> None:
    if not options:
        raise ConfigError("no units to choose formats for (an empty sensitivity table)")
    for unit, opts in options.items():
        if not opts:
            raise ConfigError(f"unit {unit!r} has no format to choose from")
        names = [o.format for o in opts]
        if len(set(names)) != len(names):
            raise ConfigError(f"unit {unit!r} lists a format twice: {names}")


def _solve(options: dict[str, list[Option]], cost: str,
           bounds: list[tuple[str, float]]) -> Choice | None:
    """Minimise the sum of ``cost`` subject to the sum of each ``(field, bound)`` <= bound."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    flat = [(unit, o) for unit, opts in options.items() for o in opts]
    n, units = len(flat), list(options)
    objective = np.array([float(getattr(o, cost)) for _, o in flat])
    one_each = np.zeros((len(units), n))
    for j, (unit, _) in enumerate(flat):
        one_each[units.index(unit), j] = 1.0
    limits = [LinearConstraint(np.array([[float(getattr(o, field)) for _, o in flat]]),
                              -np.inf, bound) for field, bound in bounds]
    result = milp(objective, integrality=np.ones(n), bounds=Bounds(0, 1),
                  constraints=[LinearConstraint(one_each, 1, 1), *limits])
    if result.status != 0 or result.x is None:
        return None
    picked = [flat[j] for j in range(n) if result.x[j] > 0.5]
    return Choice(formats={unit: o.format for unit, o in picked},
                  bytes=sum(o.bytes for _, o in picked),
                  damage=sum(o.damage for _, o in picked),
                  time=sum(o.time for _, o in picked))


def least_damage(options: dict[str, list[Option]], budget_bytes: float,
                 fixed_bytes: int = 0, max_time: float | None = None) -> Choice:
    """The choice with the least predicted damage whose weights fit ``budget_bytes``, of which
    ``fixed_bytes`` (weights no format changes) are taken already, and (``max_time``) whose
    predicted serving time is at most that share of the baseline's; totals include them."""
    _check(options)
    _reachable(options, max_time)
    return _within(options, "damage", "bytes", budget_bytes - fixed_bytes, fixed_bytes,
                   lambda tightest: (
                       f"no choice of formats fits {budget_bytes:,} bytes of weights: the "
                       f"smallest is {fixed_bytes + tightest:,.0f} bytes (every unit at its "
                       f"smallest format). Fix: BUDGET= at least {fixed_bytes + tightest:,.0f} "
                       "bytes."), max_time)


def fewest_bytes(options: dict[str, list[Option]], max_damage: float,
                 fixed_bytes: int = 0, max_time: float | None = None) -> Choice:
    """The smallest weights whose predicted damage stays within ``max_damage`` (totals include
    ``fixed_bytes``), and (``max_time``) whose predicted serving time is within that share."""
    _check(options)
    _reachable(options, max_time)
    return _within(options, "bytes", "damage", max_damage, fixed_bytes, lambda tightest: (
        f"no choice of formats keeps the predicted damage within {max_damage:g}: the least is "
        f"{tightest:g} (every unit at its least damaging format). Fix: a damage budget of at "
        f"least {tightest:g}."), max_time)


def _reachable(options: dict[str, list[Option]], max_time: float | None) -> None:
    if max_time is None:
        return
    fastest = sum(min(o.time for o in opts) for opts in options.values())
    if max_time < fastest - 1e-12:
        raise ConfigError(f"no choice of formats reaches a speedup of {1 / max_time:.3g}x: the "
                          f"fastest mix (every unit at its fastest format) is predicted at "
                          f"{1 / fastest:.3g}x. Fix: SPEEDUP= at most {1 / fastest:.3g}.")


def _within(options: dict[str, list[Option]], cost: str, bound_of: str, bound: float,
            fixed_bytes: int, unmeetable: Callable[[float], str],
            max_time: float | None = None) -> Choice:
    tightest = sum(min(getattr(o, bound_of) for o in opts) for opts in options.values())
    if bound < tightest:
        raise ConfigError(unmeetable(tightest))
    bounds = [(bound_of, bound + 1e-9 * max(1.0, abs(bound)))] if math.isfinite(bound) else []
    if max_time is not None:
        bounds.append(("time", max_time + 1e-12))
    found = _solve(options, cost, bounds)
    if found is None:
        raise ConfigError("no choice of formats meets both the speed and the "
                          f"{'memory' if bound_of == 'bytes' else 'damage'} budget; loosen "
                          "one (SPEEDUP=, or BUDGET= / MAX_DAMAGE=)")
    return Choice(found.formats, fixed_bytes + found.bytes, found.damage, found.time)

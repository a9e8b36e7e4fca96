"""``BUDGET=``: a weight-memory budget in bytes, as a share of the baseline, or as a multiple of
a uniform format's size (e.g. ``1.15xint4``: 15% above every unit at INT4)."""

from __future__ import annotations

import re

from pipeline.core.artifacts import SensitivityTable
from pipeline.core.errors import ConfigError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
         "gib": 2**30}
FORMS = "bytes (130MB, 1.3e8), a share of the baseline's weights (0.45, 45%), or a multiple " \
        "of a uniform format (1.15xint4)"


TARGET_HINT = ("If the recipe is for another machine than this one, name it: TARGET=h100-80gb "
               "(an accelerator preset), cpu-avx512 or cpu-avx2; the proof then runs emulated "
               "here.")


def unmet(text: str, why: str, left_out: dict[str, str] | None) -> ConfigError:
    """A budget no choice from the menu meets; where the menu left formats out (not served
    here), they are named with why, and TARGET= as the way out."""
    if not left_out:
        return ConfigError(f"BUDGET={text}: {why}")
    return ConfigError(f"BUDGET={text}: {why} The menu left out "
                       + "; ".join(f"{fmt} ({reason})" for fmt, reason in left_out.items())
                       + f". {TARGET_HINT}")


def _multiple(text: str) -> re.Match[str] | None:
    return re.fullmatch(r"(\d+(?:\.\d+)?)x([a-z0-9]+)", text.strip().lower().replace(" ", ""))


def check_menu(text: str, left_out: dict[str, str]) -> None:
    """Refuse a budget that is a multiple of a format the menu left out, and why (before a
    scan is measured for a search that cannot run)."""
    multiple = _multiple(text)
    if multiple and multiple[2] in left_out:
        fmt = multiple[2]
        raise ConfigError(f"BUDGET={text}: {fmt} is not in the menu: {left_out[fmt]}. "
                          f"{TARGET_HINT}")


def parse(text: str, table: SensitivityTable,
          left_out: dict[str, str] | None = None) -> tuple[int, str]:
    """(budget in bytes of total weights, how it reads); ``left_out``: the formats the menu
    left out and why (said when the budget names one)."""
    spec = text.strip().lower().replace(" ", "")
    check_menu(text, left_out or {})
    multiple = _multiple(text)
    if multiple:
        factor, fmt = float(multiple[1]), multiple[2]
        if fmt not in table.formats:
            raise ConfigError(f"BUDGET={text}: {fmt} is not in the sensitivity table's menu "
                              f"({', '.join(table.formats)}). Use one of them, or {FORMS}.")
        size = table.uniform(fmt)[0]
        return int(factor * size), f"{factor:g}x uniform {fmt} ({size:,} bytes)"
    share = re.fullmatch(r"(\d+(?:\.\d+)?)%", spec)
    if share or re.fullmatch(r"0?\.\d+|1(\.0*)?", spec):
        fraction = float(share[1]) / 100 if share else float(spec)
        if not 0 < fraction <= 1:
            raise ConfigError(f"BUDGET={text}: a share of the baseline must be in (0, 1].")
        return (int(fraction * table.baseline_weight_bytes),
                f"{fraction:.0%} of the baseline's {table.baseline_weight_bytes:,} bytes")
    size = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)([kmg]i?b|b)?", spec)
    if size:
        return int(float(size[1]) * UNITS[size[2] or ""]), f"{text.strip()}"
    raise ConfigError(f"BUDGET={text}: not a budget qpipe can read. Give {FORMS}.")


def slug(text: str) -> str:
    """A recipe-name-safe form of a budget: ``1.15xint4`` -> ``1.15xint4``, ``45%`` -> ``45pct``."""
    return re.sub(r"[^a-z0-9.]+", "-", text.strip().lower().replace("%", "pct")).strip("-.")

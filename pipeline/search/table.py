"""The sensitivity table shown: a layers x unit-kinds grid per format (text and heat-map)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from pipeline.core.artifacts import SensitivityTable
from pipeline.search.recipe import KEEP

_LAYER = re.compile(r"^(?:.*\.)?(\d+)\.(.+)$")


def _place(unit: str) -> tuple[str, str]:
    """(row, column) of a unit: ``model.layers.3.mlp.down_proj`` -> ("3", "down_proj")."""
    found = _LAYER.match(unit)
    return (found[1], found[2].rsplit(".", 1)[-1]) if found else ("-", unit)


def grid(table: SensitivityTable) -> tuple[list[str], list[str], dict[tuple[str, str], str]]:
    """Rows (layers), columns (unit kinds) and the unit at each cell."""
    cells = {_place(unit): unit for unit in table.units}
    rows = list(dict.fromkeys(r for r, _ in cells))
    cols = list(dict.fromkeys(c for _, c in cells))
    return rows, cols, cells


def render(table: SensitivityTable, top: int = 5) -> str:
    """The text form: per quantizing format a grid of KL (x1e-3 nats/token), the uniform
    totals, and the units that cost most."""
    rows, cols, cells = grid(table)
    lines = [f"Sensitivity of {table.baseline.get('name', '?')} ({table.architecture}): each unit "
             f"quantized alone, KL(baseline || variant) per token on {table.tokens} held-out "
             f"tokens; measured on {table.device} in {table.dtype} in {table.seconds:.0f} s",
             f"Units: {len(table.units)} ({table.fusion_source})"]
    for fmt in table.formats:
        if fmt == KEEP:
            continue
        size, damage = table.uniform(fmt)
        lines += ["", f"{fmt}: KL x 1e-3 per unit; every unit at {fmt}: {size / 1e6:.1f} MB of "
                  f"weights, predicted damage {damage:.4f} (sum)",
                  "layer " + "".join(f"{c[:13]:>14}" for c in cols)]
        for r in rows:
            values = [table.damage(cells[r, c], fmt).kl_div_mean * 1e3 if (r, c) in cells
                      else None for c in cols]
            lines.append(f"{r:>5} " + "".join(f"{v:14.3f}" if v is not None else f"{'':>14}"
                                              for v in values))
        worst = sorted((d for d in table.damages if d.format == fmt),
                       key=lambda d: -d.kl_div_mean)[:top]
        lines.append("most sensitive: " + ", ".join(
            f"{d.unit} {d.kl_div_mean:.4f} (top-1 {d.top1_agreement:.1%})" for d in worst))
    return "\n".join(lines)


def heatmap(table: SensitivityTable, path: Path) -> Path:
    """Layers x unit kinds, one panel per quantizing format, colour = log10 KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, cols, cells = grid(table)
    formats = [f for f in table.formats if f != KEEP]
    fig, axes = plt.subplots(1, len(formats), figsize=(2.2 + 1.1 * len(cols) * len(formats),
                                                       1.2 + 0.22 * len(rows)), squeeze=False)
    floor = 1e-6
    values = {f: np.array([[max(table.damage(cells[r, c], f).kl_div_mean, floor)
                            if (r, c) in cells else math.nan for c in cols] for r in rows])
              for f in formats}
    low = math.log10(min(np.nanmin(v) for v in values.values()))
    high = math.log10(max(np.nanmax(v) for v in values.values()))
    for ax, fmt in zip(axes[0], formats, strict=True):
        image = ax.imshow(np.log10(values[fmt]), aspect="auto", cmap="magma_r", vmin=low,
                          vmax=high)
        ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right")
        ax.set_yticks(range(len(rows)), rows)
        ax.set_title(f"{fmt}: sum {table.uniform(fmt)[1]:.3f}")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), label="log10 KL per token (nats)")
    fig.suptitle(f"{table.baseline.get('name', '?')}: damage of each unit quantized alone")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path

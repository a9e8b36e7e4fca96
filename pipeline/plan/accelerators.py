"""Accelerator presets: ``configs/accelerators/NAME.yaml``, one file per device.

Each file gives ``name``, ``description``, the memory the runtime sees (``memory_gib``, in
2^30 bytes, or ``memory_bytes``), the engine's KV ``block_size`` and, for cost figures, an
``price_per_device_hour`` (USD; an example figure with its date: set the price you pay) and
its ``compute_capability`` (which kernels vLLM chooses there: the precision search's TARGET=).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.core.errors import PlanError
from pipeline.core.paths import CONFIGS_DIR

ACCELERATORS_DIR = CONFIGS_DIR / "accelerators"
GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    description: str
    memory_bytes: int
    block_size: int = 16
    price_per_device_hour: float | None = None  # USD; the file says where it is from
    compute_capability: str = ""  # "9.0": which kernels vLLM chooses for it


def _load(path: Path) -> Accelerator:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise PlanError(f"{path}: cannot read the accelerator preset: {err}") from err
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected a mapping with name, memory_gib and block_size.")
    if "memory_bytes" in data:
        memory = int(data["memory_bytes"])
    elif "memory_gib" in data:
        memory = int(float(data["memory_gib"]) * GIB)
    else:
        raise PlanError(f"{path}: no `memory_gib` (or `memory_bytes`) field.")
    block_size = int(data.get("block_size", 16))
    if memory <= 0 or block_size <= 0:
        raise PlanError(f"{path}: memory and block_size must be positive.")
    if "price_per_hour" in data:
        raise PlanError(f"{path}: price_per_hour is now price_per_device_hour (USD per "
                        "device-hour: a server's price is that times its TP x PP GPUs).")
    price = data.get("price_per_device_hour")
    if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float))
                              or price <= 0):
        raise PlanError(f"{path}: price_per_device_hour is a positive number (USD per "
                        f"device-hour), not {price!r}.")
    return Accelerator(
        name=str(data.get("name", path.stem)),
        description=str(data.get("description", path.stem)),
        memory_bytes=memory,
        block_size=block_size,
        price_per_device_hour=float(price) if price is not None else None,
        compute_capability=str(data.get("compute_capability", "")),
    )


def known_accelerators(directory: Path = ACCELERATORS_DIR) -> dict[str, Accelerator]:
    """Every preset, by name."""
    presets = (_load(path) for path in sorted(directory.glob("*.yaml")))
    return {preset.name: preset for preset in presets}


def get_accelerator(name: str, directory: Path = ACCELERATORS_DIR) -> Accelerator:
    """The preset called ``name`` (case-insensitive), or a PlanError listing the known ones."""
    presets = known_accelerators(directory)
    preset = presets.get(name) or presets.get(name.lower())
    if preset is None:
        raise PlanError(
            f"unknown accelerator {name!r}; known: {', '.join(sorted(presets)) or 'none'} "
            f"(files in {directory}). For another device pass --memory-gb N (or --memory-gib N)."
        )
    return preset


FAMILIES = ("h200", "h100", "a100", "l40s", "l4", "a10", "b200", "gb200")


MEMORY_TOLERANCE = 0.05  # a preset is this card when their memories differ by at most this


def detect(gpu_name: str, memory_mib: int | None, directory: Path = ACCELERATORS_DIR,
           exact: bool = True) -> Accelerator | None:
    """The preset for this card: its family in the name and, ``exact``, its memory within 5%
    of the preset's (an H100 NVL's 94 GB is not the H100 80GB preset; a MIG slice is none);
    not ``exact``: the family's preset nearest in memory. None where none is."""
    name = gpu_name.lower().replace("-", " ")
    family = next((f for f in FAMILIES if f in name.split() or f in name.replace(" ", "")), None)
    if family is None:
        return None
    candidates = [p for p in known_accelerators(directory).values()
                  if p.description.lower().replace("-", " ").split()[1:2] == [family]
                  or p.name.startswith(f"{family}-")]
    if not candidates:
        return None
    if memory_mib is None:
        return candidates[0] if len(candidates) == 1 else None
    nearest = min(candidates, key=lambda p: abs(p.memory_bytes - memory_mib * 2**20))
    off = abs(nearest.memory_bytes - memory_mib * 2**20) / nearest.memory_bytes
    return nearest if not exact or off <= MEMORY_TOLERANCE else None

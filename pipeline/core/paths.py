"""File locations in one place, so that nobody spells them twice.

Every location is overridable: ``QPIPE_ARTIFACTS`` (Makefile ``ARTIFACTS=``) moves all
generated state; the project root is where ``recipes/`` and ``evals/`` live.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = PROJECT_ROOT / "recipes"
EVALS_DIR = PROJECT_ROOT / "evals"
CONFIGS_DIR = PROJECT_ROOT / "configs"
CALIBRATION_DIR = RECIPES_DIR / "calibration"


def relative(path: Path) -> Path:
    """``path`` relative to the project when inside it (shorter to read, the same on every
    checkout), else as it is."""
    try:
        return Path(path).resolve().relative_to(PROJECT_ROOT)
    except ValueError:
        return Path(path)


def shown(path: Path) -> str:
    return str(relative(path))


def find_yaml(name_or_path: str, directory: Path) -> Path | None:
    """A YAML file given by path, or by name (stem) in ``directory``; None if neither exists."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    named = directory / f"{name_or_path}.yaml"
    return named if named.is_file() else None


def yaml_names(directory: Path) -> list[str]:
    """The names (stems) of the YAML files in ``directory``."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def artifacts_dir() -> Path:
    """Root of generated state (baselines, variants, caches); git-ignored."""
    return Path(os.environ.get("QPIPE_ARTIFACTS", PROJECT_ROOT / "artifacts")).expanduser()


def baselines_dir() -> Path:
    """Where converted baselines (e.g. the embedded GGUF model as bf16 safetensors) live."""
    return artifacts_dir() / "baselines"


def variants_dir() -> Path:
    """One sub-directory per baseline, one directory per recipe below it."""
    return artifacts_dir() / "variants"


def variant_dir(baseline_name: str, recipe_name: str) -> Path:
    """The checkpoint directory of one variant: baseline name + recipe name."""
    return variants_dir() / baseline_name / recipe_name


def lock_file(kind: str, *names: str) -> Path:
    """The lock file one process holds while it makes an artifact (kept apart from the
    artifacts, so that a reader never sees one beside them)."""
    return artifacts_dir() / "locks" / kind / ("-".join(names) + ".lock")


def default_tracking_uri() -> str:
    """MLflow's store: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<root>/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{PROJECT_ROOT / 'mlflow.db'}"

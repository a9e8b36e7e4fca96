"""lm-eval task suites under ``evals/``: find them and read them.

A suite is a folder ``evals/<suite>/`` holding lm-eval task YAML files (``task:``,
``dataset_path: json`` and ``dataset_kwargs.data_files`` relative to the project root);
``SUITE=<suite>`` selects it. Folders and files whose name starts with ``_`` are not tasks
(``evals/_template`` is the one to copy, ``evals/_heldout`` holds the divergence text).
Preparing packaged data is :mod:`pipeline.eval.prepare`; checking a new task,
:mod:`pipeline.eval.validate`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import log as qlog
from pipeline.core import paths
from pipeline.core.errors import ConfigError
from pipeline.core.paths import relative

log = qlog.get("suites")

# Extra keys qpipe reads from a task's ``metadata`` (lm-eval ignores them).
META_LIMIT = "qpipe_limit"  # items scored by default (LIMIT= overrides)
META_METRIC = "qpipe_metric"  # the metric recovery and the gate use, e.g. "acc,none"
LOCAL_BUILDERS = {"json", "csv", "parquet", "text"}
SPLIT_KEYS = ("test_split", "validation_split", "training_split", "fewshot_split")
MAX_REPORTED = 12  # problems listed per validation


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a task file or its data, and how to fix it."""

    file: Path
    line: int | None
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"{relative(self.file)}" + (f", line {self.line}" if self.line else "")
        return f"{where}: {self.message} Fix: {self.fix}"


@dataclass(frozen=True)
class Task:
    """One lm-eval task of a suite, as qpipe needs it."""

    name: str
    suite: str
    path: Path
    config: dict[str, Any]
    data_files: dict[str, list[Path]]
    sha256: str  # the YAML (and its includes) plus every data file
    default_limit: int | None
    primary_metric: str  # "acc,none", "exact_match,strict-match", ...
    include_path: Path = field(default=Path())  # the folder lm-eval scans (its suite folder)

    @property
    def output_type(self) -> str:
        return str(self.config.get("output_type", "generate_until"))


# ---------------------------------------------------------------------------- YAML reading


class TaskFileError(ConfigError):
    """A task file that cannot be read or parsed; carries its :class:`Problem`."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


class FunctionRef(str):
    """``!function utils.fn`` kept as text (validation does not import task code)."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor(
    "!function", lambda loader, node: FunctionRef(loader.construct_scalar(node)))


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line, for every key of nested mappings."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, f"{key}."))
    return lines


@dataclass
class TaskFile:
    """A task YAML with its includes merged, and where each key was set."""

    path: Path
    config: dict[str, Any]
    lines: dict[str, tuple[Path, int]]  # dotted key -> (file, line)
    sources: list[Path]  # the file and its includes

    def where(self, key: str) -> tuple[Path, int | None]:
        for probe in (key, key.rsplit(".", 1)[0], key.split(".", 1)[0]):
            if probe in self.lines:
                return self.lines[probe]
        return self.path, None


def read_task_file(path: Path, _seen: frozenset[Path] = frozenset()) -> TaskFile:
    """Parse a task YAML like lm-eval does (``include:`` merged, local keys win)."""
    path = path.resolve()
    if path in _seen:
        raise TaskFileError(Problem(path, None, "`include` cycle.",
                                    "remove the include that points back to this file."))
    try:
        text = path.read_text()
    except OSError as err:
        raise TaskFileError(Problem(path, None, f"cannot read the task file ({err.strerror}).",
                                    "check the path.")) from None
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        column = f"column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise TaskFileError(Problem(
            path, mark.line + 1 if mark else None, f"{column}malformed YAML ({problem}).",
            "correct the YAML there (indentation, quotes around text with ':' or '#').")) from None
    if not isinstance(data, dict):
        raise TaskFileError(Problem(path, None, "a task file is a YAML mapping (task:, "
                                    f"dataset_path:, ...), got {type(data).__name__}.",
                                    "copy evals/_template/template_task.yaml."))
    lines = {k: (path, n) for k, n in _key_lines(node).items()}
    merged: dict[str, Any] = {}
    merged_lines: dict[str, tuple[Path, int]] = {}
    sources = [path]
    includes = data.pop("include", None)
    for inc in [] if includes is None else includes if isinstance(includes, list) else [includes]:
        inc_path = Path(inc) if Path(inc).is_absolute() else path.parent / str(inc)
        if not inc_path.is_file():
            raise TaskFileError(Problem(path, lines.get("include", (path, None))[1],
                                        f"the included file {inc} does not exist.",
                                        "point `include` at a YAML file next to this one."))
        included = read_task_file(inc_path, _seen | {path})
        included.config.pop("task_list", None)
        merged.update(included.config)
        merged_lines.update(included.lines)
        sources += included.sources
    merged.update(data)
    merged_lines.update(lines)
    return TaskFile(path, merged, merged_lines, sources)


# ---------------------------------------------------------------------------- discovery


def task_files(root: Path) -> Iterator[Path]:
    """Task YAMLs under ``root`` (a suite folder or evals/), skipping ``_``/``.`` names."""
    if root.is_file():
        yield root
        return
    for p in sorted(root.rglob("*.y*ml")):
        rel = p.relative_to(root).parts
        if p.suffix in (".yaml", ".yml") and not any(s.startswith(("_", ".")) for s in rel):
            yield p


def data_root() -> Path:
    """Where ``data_files`` paths are relative to: the project root (where make runs)."""
    return paths.PROJECT_ROOT


def data_files(config: dict[str, Any]) -> dict[str, list[Path]]:
    spec = (config.get("dataset_kwargs") or {}).get("data_files")
    if spec is None:
        return {}
    if isinstance(spec, (str, list)):
        spec = {"train": spec}
    out = {}
    for split, files in dict(spec).items():
        items = files if isinstance(files, list) else [files]
        out[str(split)] = [p if (p := Path(str(f))).is_absolute() else data_root() / p
                           for f in items]
    return out


def primary_metric(config: dict[str, Any]) -> str:
    """The metric recovery and the gate use: ``metadata.qpipe_metric``, else the first one."""
    meta = config.get("metadata") or {}
    if isinstance(meta, dict) and meta.get(META_METRIC):
        return str(meta[META_METRIC])
    metrics = config.get("metric_list") or []
    name = metrics[0]["metric"] if metrics and isinstance(metrics[0], dict) else (
        "acc" if config.get("output_type") in ("multiple_choice",) else "exact_match")
    filters = config.get("filter_list") or []
    flt = filters[0].get("name", "none") if filters and isinstance(filters[0], dict) else "none"
    return f"{name},{flt}"


def load_task(path: Path, suite: str | None = None) -> Task:
    """A task file as a :class:`Task` (no validation beyond parsing)."""
    tf = read_task_file(path)
    name = tf.config.get("task")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{relative(path)}: no `task:` name. Fix: add `task: my_task` (letters, "
                          "digits and _), unique under evals/.")
    files = data_files(tf.config)
    digest = hashlib.sha256()
    for src in tf.sources:
        digest.update(src.read_bytes())
    for split in sorted(files):
        for f in files[split]:
            digest.update(split.encode())
            digest.update(f.read_bytes() if f.is_file() else b"<missing>")
    meta = tf.config.get("metadata") or {}
    limit = meta.get(META_LIMIT) if isinstance(meta, dict) else None
    root = paths.EVALS_DIR.resolve()
    resolved = path.resolve()
    in_evals = resolved.is_relative_to(root) and len(resolved.relative_to(root).parts) > 1
    suite = suite or (resolved.relative_to(root).parts[0] if in_evals else resolved.parent.name)
    metric = primary_metric(tf.config)
    _check_direction(path, tf.config, metric)
    return Task(name=name, suite=suite, path=resolved, config=tf.config, data_files=files,
                sha256=digest.hexdigest()[:16], default_limit=int(limit) if limit else None,
                primary_metric=metric, include_path=resolved.parent)


def _check_direction(path: Path, config: dict[str, Any], metric: str) -> None:
    """Recovery is variant / baseline of a score where higher is better: a lower-is-better
    primary metric (perplexity, an error rate) would be read inverted, so it is refused."""
    name = metric.split(",", 1)[0]
    for entry in config.get("metric_list") or []:
        if isinstance(entry, dict) and entry.get("metric") == name \
                and entry.get("higher_is_better") is False:
            raise ConfigError(
                f"{relative(path)}: the primary metric {name!r} has higher_is_better: false; "
                "recovery (variant / baseline) and its gate assume higher is better, so this "
                f"task would be judged inverted. Fix: set metadata.{META_METRIC} to a "
                "higher-is-better metric of the task, or score it outside the gate.")


def builtin_task_sha(name: str) -> str:
    """The identity of an lm-eval built-in task (not in evals/): its name at this lm-eval."""
    from importlib import metadata

    return hashlib.sha256(f"{name}@{metadata.version('lm_eval')}".encode()).hexdigest()[:16]


def discover(evals_dir: Path | None = None) -> dict[str, list[Task]]:
    """Suite name -> its tasks, for every suite folder under ``evals/``."""
    evals_dir = evals_dir or paths.EVALS_DIR
    out: dict[str, list[Task]] = {}
    for folder in sorted(p for p in evals_dir.iterdir() if p.is_dir()):
        if folder.name.startswith(("_", ".")):
            continue
        tasks = [load_task(f, folder.name) for f in task_files(folder)]
        tasks = [t for t in tasks if "group" not in t.config]
        if tasks:
            out[folder.name] = tasks
    return out


def select(suites: list[str] | None = None, tasks: list[str] | None = None,
           evals_dir: Path | None = None) -> list[Task]:
    """The tasks of the named suites (default: every suite), or the named tasks."""
    found = discover(evals_dir)
    if tasks:
        by_name = {t.name: t for ts in found.values() for t in ts}
        missing = [n for n in tasks if n not in by_name]
        if missing:
            raise ConfigError(
                f"unknown task {', '.join(missing)}: the tasks in evals/ are "
                f"{', '.join(sorted(by_name)) or '(none)'}. Fix: name one of them, or add a task "
                "folder (docs/evals.md).")
        return [by_name[n] for n in tasks]
    names = suites or list(found)
    unknown = [s for s in names if s not in found]
    if unknown:
        raise ConfigError(
            f"unknown suite {', '.join(unknown)}: the suites in "
            f"{relative(evals_dir or paths.EVALS_DIR)} are {', '.join(found) or '(none)'}. "
            "Fix: set SUITE= to one of them, or create "
            f"evals/{unknown[0]}/ from evals/_template/ (docs/evals.md).")
    if not names:
        raise ConfigError(f"no task suite in {relative(evals_dir or paths.EVALS_DIR)}. Fix: "
                          "restore evals/app from git, or add one from evals/_template "
                          "(docs/evals.md).")
    return [t for s in names for t in found[s]]




class chdir:  # contextlib.chdir is Python 3.11+
    """Run a block in another working directory."""

    def __init__(self, path: Path) -> None:
        self.path, self.old = path, ""

    def __enter__(self) -> None:
        self.old = os.getcwd()
        os.chdir(self.path)

    def __exit__(self, *exc: object) -> None:
        os.chdir(self.old)


def all_task_names(evals_dir: Path | None = None) -> dict[str, Path]:
    """Task name -> file, for every task YAML under evals/ (the template included)."""
    names: dict[str, Path] = {}
    for f in task_files_all(evals_dir or paths.EVALS_DIR):
        try:
            name = read_task_file(f).config.get("task")
        except TaskFileError:
            continue
        if isinstance(name, str):
            names.setdefault(name, f)
    return names


def task_files_all(evals_dir: Path) -> Iterator[Path]:
    for p in sorted(evals_dir.rglob("*.y*ml")):
        if p.suffix in (".yaml", ".yml") and not p.name.startswith(("_", ".")):
            yield p

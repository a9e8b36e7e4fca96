"""qpipe eval: per-sample scores, caching, MLflow, the served path, equality with lm_eval."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import paths, tracking
from pipeline.core.artifacts import RecoverySummary
from pipeline.core.errors import ConfigError
from pipeline.core.settings import add_options, from_args
from pipeline.core.variant import Variant, baseline_variant, variants_of
from pipeline.eval import EvalSettings, lm, score, suites, validate
from pipeline.eval import stage as evaluate
from pipeline.eval import summary as eval_summary
from pipeline.quantize import baseline as baselines
from pipeline.quantize import recipes
from pipeline.quantize import stage as quantize

from .conftest import run_cli

MC_SAMPLES = [  # the shape of lm-eval 0.4.13's per-sample records (log_samples)
    {"doc_id": 0, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": 1.0, "acc_norm": 1.0,
     "arguments": [["q", " a"], ["q", " b"]]},
    {"doc_id": 1, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": 0.0, "acc_norm": 1.0,
     "arguments": [["q", " a"], ["q", " b"], ["q", " c"], ["q", " d"]]},
]
GEN_SAMPLES = [
    {"doc_id": 0, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 1.0,
     "arguments": [["q", {"until": ["\n"]}]]},
    {"doc_id": 0, "filter": "flexible-extract", "metrics": ["exact_match"], "exact_match": 0.0,
     "arguments": [["q", {"until": ["\n"]}]]},
]


def test_per_item_scores_and_chance_levels() -> None:
    scores, chance = lm.per_item_scores(MC_SAMPLES, "multiple_choice")
    assert scores == {"acc,none": {"0": 1.0, "1": 0.0}, "acc_norm,none": {"0": 1.0, "1": 1.0}}
    assert chance["acc,none"] == pytest.approx((1 / 2 + 1 / 4) / 2)
    scores, chance = lm.per_item_scores(GEN_SAMPLES, "generate_until")
    assert scores == {"exact_match,strict-match": {"0": 1.0},
                      "exact_match,flexible-extract": {"0": 0.0}}
    assert chance == {"exact_match,strict-match": 0.0, "exact_match,flexible-extract": 0.0}


def test_metric_names_are_valid_mlflow_names() -> None:
    assert eval_summary.metric_name("app_facts", "acc,none") == "app_facts.acc"
    assert eval_summary.metric_name("qpipe_gsm8k", "exact_match,strict-match") == \
        "qpipe_gsm8k.exact_match/strict-match"


def _result(task: str, items: list[float], chance: float = 0.5) -> lm.TaskResult:
    per_item = {"acc,none": {str(i): v for i, v in enumerate(items)}}
    return lm.TaskResult(task=task, backend="served", metrics={}, per_item=per_item,
                               chance={"acc,none": chance}, settings={}, command="")


def test_a_builtin_tasks_primary_metric_is_one_lm_eval_says_is_higher_is_better() -> None:
    """A built-in task (``TASKS=``) has no qpipe_metric: the first metric scored may be a
    perplexity (lambada_openai's), which recovery would read inverted."""
    builtin = suites.Task(name="lambada_openai", suite="lm-eval", path=Path(), config={},
                          data_files={}, sha256="x", default_limit=None, primary_metric="")
    items = {"0": 1.0, "1": 0.0}
    result = lm.TaskResult(
        task="lambada_openai", backend="served", metrics={}, chance={}, settings={}, command="",
        per_item={"perplexity,none": {"0": 3.1, "1": 9.7}, "acc,none": items},
        higher_is_better={"perplexity": False, "acc": True})
    assert lm.primary_key(builtin, result) == "acc,none"
    result.per_item.pop("acc,none")
    with pytest.raises(lm.EvalError, match=r"lambada_openai: .*lower-is-better.*qpipe_metric"):
        lm.primary_key(builtin, result)


def test_compare_and_suite_figure_from_paired_items() -> None:
    tasks = suites.select(["app"])
    base = {t.name: _result(t.name, [1.0] * 16 + [0.0] * 4) for t in tasks}
    var = {t.name: _result(t.name, [1.0] * 12 + [0.0] * 8) for t in tasks}
    var["app_json"] = _result("app_json", [1.0] * 16 + [0.0] * 4)
    rec = eval_summary.compare(tasks, base, var)
    assert rec["app_facts"]["acc,none"].recovery_pct == pytest.approx(75.0)
    assert rec["app_json"]["acc,none"].recovery_pct == pytest.approx(100.0)
    fig = eval_summary.run_suite_figures(tasks, rec)["app"]
    assert fig.recovery_pct == pytest.approx((75 + 75 + 100) / 3)
    assert fig.items == 60 and fig.ci_low < fig.recovery_pct < fig.ci_high


def test_task_limits_and_cache_keys_follow_the_settings() -> None:
    gsm8k = next(t for t in suites.select(["standard"]) if t.name == "qpipe_gsm8k")
    assert EvalSettings().for_task(gsm8k)["limit"] == 20  # the task's qpipe_limit
    assert EvalSettings(limit=7).for_task(gsm8k)["limit"] == 7
    assert EvalSettings(limit="all").for_task(gsm8k)["limit"] is None  # every item
    model = Variant("int4", paths.PROJECT_ROOT, "abc")
    keys = {score.task_key(model, gsm8k, b, EvalSettings(limit=n))
            for b in (lm.SERVED, lm.EMULATED) for n in (5, 6)}
    assert len(keys) == 4


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_a_bad_limit_names_the_option(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, EvalSettings)
    with pytest.raises((ConfigError, SystemExit)) as info:
        from_args(EvalSettings, parser.parse_args(["--limit", bad]))
    said = str(info.value) + capsys.readouterr().err
    assert "limit" in said and ("greater than 0" in said or "'all'" in said)


def test_an_unknown_variant_says_how_to_make_it(workspace: Path, tiny_model: Path) -> None:
    base = baselines.resolve(str(tiny_model))
    with pytest.raises(ConfigError, match="make quantize RECIPE=int4"):
        variants_of(base, ["int4"])
    assert variants_of(base, None) == []


def _runs(workspace: Path, baseline_name: str) -> list:
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workspace / 'mlflow.db'}")
    exp = mlflow.get_experiment_by_name(tracking.experiment_name(baseline_name))
    runs = mlflow.search_runs([exp.experiment_id], output_format="list") if exp else []
    return [r for r in runs if r.data.tags.get(tracking.TAG_STAGE) == eval_summary.STAGE]


def _new_task_as_the_docs_say(evals: Path) -> None:
    """docs/evals.md, "Add your own task": copy the template, rename, edit, write items."""
    shutil.copytree(paths.EVALS_DIR / "_template", evals / "myapp")
    (evals / "myapp" / "template_task.yaml").rename(evals / "myapp" / "myapp_support.yaml")
    data = evals / "myapp" / "data" / "examples.jsonl"
    # A random tiny model gives every token about the same probability, so it prefers the
    # shortest choice: make that the right one and the baseline is far above chance.
    rows = [{"context": f"Customer: request {i}.\nAgent:",
             "choices": ["I will help.", "I will transfer you to another department now, sir."],
             "label": 0} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = evals / "myapp" / "myapp_support.yaml"
    task.write_text(task.read_text().replace("task: template_task", "task: myapp_support")
                    .replace("evals/_template/data/examples.jsonl", str(data)))


@pytest.mark.slow
def test_emulated_end_to_end_with_a_new_task(
    workspace: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evals = workspace / "evals"
    evals.mkdir()
    (evals / "app").symlink_to(paths.EVALS_DIR / "app")
    shutil.copytree(paths.EVALS_DIR / "_template", evals / "_template")
    _new_task_as_the_docs_say(evals)
    monkeypatch.setattr(paths, "EVALS_DIR", evals)
    validate.validate([evals / "myapp"])

    base = baselines.resolve(str(tiny_model))
    quantize.quantize(base, recipes.load("fp8"))
    (variant,) = variants_of(base, None)
    tasks = suites.select(["app", "myapp"])
    settings = EvalSettings(limit=6, backend="hf")
    report = evaluate.evaluate(base, [variant], tasks, settings)
    assert report["fp8"].backend == lm.EMULATED
    assert all(len(r.per_item["acc,none"]) == 6 for r in report["fp8"].results.values())
    assert all(r.higher_is_better.get("acc") is True for r in report["fp8"].results.values())
    # FP8 moves the tiny model's distributions a little, not a lot
    assert 0 < report["fp8"].divergence.kl_div_mean < 1

    summary = RecoverySummary.load(base.name, "fp8")
    assert set(summary.tasks) == {"app_facts", "app_grammar", "app_json", "myapp_support"}
    assert summary.tasks["app_facts"].settings["limit"] == 6
    assert summary.tasks["app_facts"].backend == "emulated"

    runs = {r.data.params["recipe"]: r for r in _runs(workspace, base.name)}
    assert set(runs) == {"none", "fp8"}
    var_run = runs["fp8"]
    assert var_run.data.tags[tracking.TAG_EVAL_BACKEND] == "emulated"
    assert var_run.data.params["baseline"] == base.name
    assert var_run.data.params["limit.app_facts"] == "6"
    metrics = var_run.data.metrics
    assert metrics["myapp_support.acc"] == 1.0
    # the new task is above chance: its recovery is in MLflow, with its interval
    assert metrics["recovery_pct.myapp_support"] == pytest.approx(100.0)
    assert metrics["recovery_pct_ci_low.myapp_support"] <= 100.0
    assert metrics["recovery_pct"] == pytest.approx(100.0)
    assert "flip_rate.myapp_support" in metrics and "suite_recovery_pct.myapp" in metrics
    assert {"kl_div_mean", "top1_agreement", "perplexity"} <= set(metrics)
    # a random tiny model is at chance on the app suite: not meaningful, not a recovery
    assert "recovery_pct.app_grammar" not in metrics
    assert "app_grammar" in var_run.data.tags[tracking.TAG_NOT_MEANINGFUL]
    assert "perplexity" in runs["none"].data.metrics
    import mlflow

    names = {a.path for a in mlflow.tracking.MlflowClient().list_artifacts(var_run.info.run_id)}
    assert {"results_app_facts.json", "samples_myapp_support.jsonl", "recovery.json"} <= names

    # unchanged: nothing is scored again and nothing new is logged
    scored = score.cache_root(base.name) / "cache"
    mtimes = {p: p.stat().st_mtime_ns for p in scored.rglob("*") if p.is_file()}
    evaluate.evaluate(base, [variant], tasks, settings)
    assert {p: p.stat().st_mtime_ns for p in scored.rglob("*") if p.is_file()} == mtimes
    assert len(_runs(workspace, base.name)) == 2


@pytest.mark.slow
def test_cli_eval_then_gate(workspace: Path, tiny_model: Path) -> None:
    base = baselines.resolve(str(tiny_model))
    quantize.quantize(base, recipes.load("fp8"))
    done = run_cli("eval", "--baseline", str(tiny_model), "--task", "app_json", "--limit", "4",
                   "--backend", "hf", "--no-divergence", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert RecoverySummary.load(base.name, "fp8").tasks["app_json"].settings["limit"] == 4
    assert "reproduce a score by hand" in done.stdout
    # at chance everywhere: the gate cannot pass it, and says why
    gated = run_cli("gate", "--baseline", str(tiny_model), timeout=120)
    assert gated.returncode == 1
    assert "where the baseline is above chance" in gated.stderr


@pytest.mark.slow
def test_scores_equal_a_direct_lm_eval_run(workspace: Path, tiny_model: Path) -> None:
    base = baselines.resolve(str(tiny_model))
    (task,) = suites.select(tasks=["app_grammar"])
    model = baseline_variant(base)
    result = score.score(base.name, model, [task], lm.EMULATED, EvalSettings(limit=12))[task.name]
    # the command qpipe prints, run as a user runs it
    args = shlex.split(result.command)
    assert args[:3] == [".venv/bin/lm_eval", "--model", "hf"]
    out = workspace / "by-hand"
    args[args.index("--output_path") + 1] = str(out)
    lm_eval = Path(sys.executable).parent / "lm_eval"
    done = subprocess.run([str(lm_eval), *args[1:]], cwd=paths.PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    (results_file,) = out.rglob("results_*.json")
    by_hand = json.loads(results_file.read_text())["results"][task.name]
    assert by_hand["acc,none"] == result.metrics["acc,none"]
    (samples_file,) = out.rglob(f"samples_{task.name}_*.jsonl")
    hand_items = {str(json.loads(line)["doc_id"]): json.loads(line)["acc"]
                  for line in samples_file.read_text().splitlines()}
    assert hand_items == result.per_item["acc,none"]


@pytest.mark.slow
@pytest.mark.serve
@pytest.mark.xdist_group("servers")
def test_served_end_to_end_through_vllm(workspace: Path, tiny_model: Path) -> None:
    # fp8: served by vLLM CPU on AVX2 and AVX-512 machines alike (W4A16 needs AVX-512)
    base = baselines.resolve(str(tiny_model))
    quantize.quantize(base, recipes.load("fp8"))
    (variant,) = variants_of(base, ["fp8"])
    tasks = suites.select(tasks=["app_facts", "app_json"])
    settings = EvalSettings(limit=5, num_concurrent=2, divergence=False)
    report = evaluate.evaluate(base, [variant], tasks, settings)
    assert report["fp8"].backend == lm.SERVED
    results = report["fp8"].results
    assert all(len(r.per_item["acc,none"]) == 5 for r in results.values())
    assert "--model local-completions" in results["app_facts"].command
    # the served baseline scores what the hf backend scores on the same items (bf16 both ways)
    served = report["baseline (served)"].results["app_facts"].per_item["acc,none"]
    hf = score.score(base.name, baseline_variant(base), tasks[:1], lm.EMULATED,
                     settings)["app_facts"].per_item["acc,none"]
    agree = sum(served[k] == hf[k] for k in served)
    assert agree >= 4  # bf16 rounding may flip a near-tie
    (run,) = [r for r in _runs(workspace, base.name) if r.data.params["recipe"] == "fp8"]
    assert run.data.tags[tracking.TAG_EVAL_BACKEND] == "served"


def _block_checkpoint(path: Path, out: int, width: int) -> Path:
    """A config.json and safetensors header of an FP8 block-wise checkpoint, one layer."""
    import torch
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({"quantization_config": {
        "format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                        "block_structure": [128, 128]}}}}}))
    save_file({"q.weight": torch.zeros(out, width, dtype=torch.float8_e4m3fn),
               "q.weight_scale": torch.zeros(-(-out // 128), -(-width // 128))},
              str(path / "model.safetensors"))
    return path


def test_a_checkpoint_compressed_tensors_cannot_decompress_is_unsupported_not_failed(
        workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM refused it and compressed-tensors cannot de-compress its partial blocks: no backend
    here scores it, which is the format's limit on this model, recorded as unsupported."""
    words = "unflatten: Provided sizes [5, 128] don't multiply up to the size of dim 2 (576)"

    def refuse(path: Path) -> None:
        raise RuntimeError(words)
    monkeypatch.setattr(lm.divergence, "load_model", refuse)
    partial = Variant("fp8-block", _block_checkpoint(workspace / "partial", 576, 576), "I1")
    with pytest.raises(lm.NotDecompressible) as err, \
            lm.open_lm(partial, lm.EMULATED, EvalSettings(), workspace):
        pass
    assert words in str(err.value) and "q (576 x 576)" in str(err.value)
    assert eval_summary.write_failure("Tiny", partial, err.value).status == "unsupported"
    # whole blocks: the library's error is a failure, raised as it is
    whole = Variant("fp8-block", _block_checkpoint(workspace / "whole", 256, 128), "I2")
    with pytest.raises(RuntimeError, match="unflatten"), \
            lm.open_lm(whole, lm.EMULATED, EvalSettings(), workspace):
        pass


def test_a_block_checkpoint_that_fails_to_decompress_inside_a_task_is_unsupported_too(
        workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers may load such a checkpoint and de-compress it only when lm-eval runs it
    (seen on an AVX-512 host): the same limit, raised from the task, is unsupported as well."""
    from contextlib import contextmanager

    words = "unflatten: Provided sizes [5, 128] don't multiply up to the size of dim 2 (576)"

    @contextmanager
    def loaded(*args: object, **kwargs: object):
        yield object(), None, None

    def run(*args: object, **kwargs: object) -> None:
        raise lm.EvalError(f"lm-eval failed on task app_facts: RuntimeError: {words}")
    monkeypatch.setattr(score, "open_lm", loaded)
    monkeypatch.setattr(score, "run_task", run)
    task = suites.select(tasks=["app_facts"])
    partial = Variant("fp8-block", _block_checkpoint(workspace / "partial", 576, 576), "I1")
    with pytest.raises(lm.NotDecompressible, match="q \\(576 x 576\\)"):
        score.score("Tiny", partial, task, lm.EMULATED, EvalSettings(), force=True)
    whole = Variant("fp8-block", _block_checkpoint(workspace / "whole", 256, 128), "I2")
    with pytest.raises(lm.EvalError, match="unflatten") as err:
        score.score("Tiny", whole, task, lm.EMULATED, EvalSettings(), force=True)
    assert not isinstance(err.value, lm.NotDecompressible)

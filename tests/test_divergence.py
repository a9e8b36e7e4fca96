"""KL divergence, top-1 agreement and perplexity: hand-computed cases, then tiny models."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.core import heldout, paths
from pipeline.core.errors import ConfigError
from pipeline.eval import divergence

from .conftest import make_tiny_llama


def _log(probs: list[list[float]]):  # -> a torch tensor
    import torch

    return torch.tensor(probs).log()


def test_token_stats_match_hand_computed_values() -> None:
    import torch

    base = _log([[0.5, 0.5], [0.8, 0.2]])
    var = _log([[0.9, 0.1], [0.8, 0.2]])
    stats = heldout.token_stats(base, var, torch.tensor([1, 0]))
    # KL(p || q) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108; identical rows: 0
    assert stats["kl"].tolist() == pytest.approx([0.5108256, 0.0], abs=1e-6)
    # row 0: argmax 0 vs 0 (ties break to the first index in torch) -> agree; row 1 agrees
    assert stats["agree"].tolist() == [True, True]
    # NLL of the actual tokens: -ln 0.5, -ln 0.8 (baseline); -ln 0.1, -ln 0.8 (variant)
    assert stats["nll_base"].tolist() == pytest.approx([math.log(2), -math.log(0.8)], abs=1e-6)
    assert stats["nll_var"].tolist() == pytest.approx([-math.log(0.1), -math.log(0.8)], abs=1e-6)
    disagree = heldout.token_stats(_log([[0.6, 0.4]]), _log([[0.3, 0.7]]), torch.tensor([0]))
    assert disagree["agree"].tolist() == [False]


def test_windows_cover_every_token_once() -> None:
    ids = list(range(10))
    assert heldout.windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # a last window of one token predicts nothing
    assert heldout.windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_the_scan_and_the_check_score_disjoint_parts_of_the_text() -> None:
    """The precision search chooses units on the first 1,024 tokens; the divergence check that
    proves the choice measures only after them."""
    from pipeline.core import heldout
    from pipeline.search.settings import ScanOptions

    ids = list(range(3000))
    scan, proof = heldout.scan_part(ids), heldout.proof_part(ids)
    assert len(scan) == heldout.SCAN_SPAN and not set(scan) & set(proof)
    assert scan + proof == ids and heldout.scan_part(ids, 64) == ids[:64]
    with pytest.raises(ConfigError, match=r"SCAN_TOKENS=2048: .* first 1,024 tokens"):
        heldout.scan_part(ids, 2048)
    with pytest.raises(ValidationError):
        ScanOptions(scan_tokens=2048)


def test_heldout_text_is_there_and_checked(tmp_path: Path) -> None:
    assert len(heldout.heldout_text().split()) > 1000
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ConfigError, match="fewer than 50 words"):
        heldout.heldout_text(short)


@pytest.mark.slow
def test_tiny_models_identical_and_different(tmp_path: Path, tiny_model: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    other = make_tiny_llama(tmp_path / "other", seed=1)
    text = " ".join(heldout.heldout_text().split()[:300])  # a short text keeps it quick
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    self_cache, cache = tmp_path / "self.json", tmp_path / "div.json"
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)  # the same weights, loaded a second time on their own
    figures = divergence.measure_all(tiny_model, {tiny_model: self_cache, other: cache,
                                                  copy: tmp_path / "copy.json"},
                                     text_path=text_file, seq_len=128, skip=0)
    same, diff, twin = figures[tiny_model], figures[other], figures[copy]
    assert same.perplexity == pytest.approx(same.baseline_perplexity)
    # identical models through two separate loads: no divergence, every token agrees
    assert twin.kl_div_mean == pytest.approx(0.0, abs=1e-6) and twin.top1_agreement == 1.0
    assert twin.perplexity == pytest.approx(same.baseline_perplexity, rel=1e-6)

    # perplexity by hand over the same windows
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    a = divergence.load_model(tiny_model)
    ids = tokenizer(text).input_ids
    nll, count = 0.0, 0
    for window in heldout.windows(ids, 128):
        with torch.inference_mode():
            lp = torch.log_softmax(a(torch.tensor([window])).logits[0, :-1].float(), -1)
        nll -= float(lp.gather(-1, torch.tensor(window[1:]).unsqueeze(-1)).sum())
        count += len(window) - 1
    assert same.tokens == count
    assert same.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)

    assert diff.kl_div_mean > 0.01 and diff.top1_agreement < 1.0
    assert diff.baseline_perplexity == pytest.approx(same.baseline_perplexity, rel=1e-3)
    assert json.loads(cache.read_text()) == diff.as_dict()
    assert divergence.measure_all(tiny_model, {other: cache})[other] == diff  # from the cache
    # the check measures after the scan's part of the text: fewer tokens, none of the scan's
    later = divergence.measure_all(tiny_model, {tiny_model: tmp_path / "later.json"},
                                   text_path=text_file, seq_len=128, skip=100)[tiny_model]
    assert later.tokens == sum(len(w) - 1 for w in heldout.windows(ids[100:], 128))


@pytest.mark.slow
def test_identical_models_scored_through_two_loads_flip_nothing(
        workspace: Path, tiny_model: Path, tmp_path: Path) -> None:
    from pipeline.core.variant import Variant, baseline_variant
    from pipeline.eval import EvalSettings, lm, suites
    from pipeline.eval.score import score
    from pipeline.eval.summary import compare
    from pipeline.quantize import baseline as baselines

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    base = baselines.resolve(str(tiny_model))
    tasks = suites.select(tasks=["app_grammar"])
    settings = EvalSettings(limit=12)
    ours = score(base.name, baseline_variant(base), tasks, lm.EMULATED, settings)
    twin = score(base.name, Variant("copy", copy, "copy-identity"), tasks, lm.EMULATED, settings)
    (r,) = compare(tasks, ours, twin)["app_grammar"].values()
    assert r.n == 12 and r.flips == 0 and r.variant_score == r.baseline_score


def test_transformers_run_in_bf16_only_where_it_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on a CPU without bf16 units (torch emulates bf16 there, ~4x slower)."""
    from types import SimpleNamespace

    monkeypatch.setattr(divergence.hardware, "torch_device", lambda: "cpu")
    for flags, dtype in ((("avx2",), "float32"), (("avx2", "avx512f", "avx512_bf16"), "bfloat16"),
                         (("avx2", "amx_tile", "amx_bf16"), "bfloat16")):
        monkeypatch.setattr(divergence.hardware, "profile",
                            lambda flags=flags: SimpleNamespace(cpu_flags=flags))
        assert divergence.hf_dtype() == dtype
    monkeypatch.setattr(divergence.hardware, "torch_device", lambda: "cuda")
    assert divergence.hf_dtype() == "bfloat16"


@pytest.mark.slow
def test_an_fp4_checkpoint_runs_in_float32_with_its_layers_in_bf16(
        workspace: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compressed-tensors de-compresses MXFP4 weights to bf16 whatever dtype is asked for: in
    float32 its quantized layers compute in bf16, as the bf16 path does, and the rest in
    float32; an FP8 checkpoint runs in float32 throughout."""
    import torch

    from pipeline.quantize import baseline as baselines
    from pipeline.quantize import recipes
    from pipeline.quantize import stage as quantize

    base = baselines.resolve(str(tiny_model))
    ids = torch.tensor([list(range(5, 69))])
    for recipe, hooked in (("mxfp4", True), ("fp8", False)):
        quantize.quantize(base, recipes.load(recipe))
        variant = paths.variant_dir(base.name, recipe)
        logits = {}
        for dtype in ("bfloat16", "float32"):
            monkeypatch.setattr(divergence, "hf_dtype", lambda dtype=dtype: dtype)
            model = divergence.load_model(variant)
            with torch.inference_mode():
                logits[dtype] = model(ids).logits
            assert any(m._forward_pre_hooks for m in model.modules()) == (
                hooked and dtype == "float32")
        assert logits["float32"].dtype == torch.float32
        top = logits["bfloat16"].float().argmax(-1) == logits["float32"].argmax(-1)
        assert float(top.float().mean()) > 0.9, recipe

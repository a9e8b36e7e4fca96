"""Precision search: fused units, the exact solver, the emitted recipe, the menu, the stages."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from pipeline.core import paths
from pipeline.core.artifacts import SensitivityTable, UnitDamage
from pipeline.core.errors import ConfigError, RecipeError
from pipeline.search import budget as budgets
from pipeline.search import measured, stage
from pipeline.search import menu as menus
from pipeline.search import recipe as searched
from pipeline.search import table as tables
from pipeline.search.settings import ScanOptions, SearchSettings
from pipeline.search.solver import Choice, Option, fewest_bytes, least_damage
from pipeline.search.units import fuse

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj",
                                                                              "up_proj"]}


def _linears(layers: int) -> list[str]:
    return [f"model.layers.{i}.{part}" for i in range(layers) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def test_layers_vllm_fuses_are_one_unit_and_the_rest_their_own():
    units = fuse(_linears(2), LLAMA_PACKED)
    assert list(units)[:4] == ["model.layers.0.self_attn.qkv_proj",
                               "model.layers.0.self_attn.o_proj",
                               "model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"]
    assert units["model.layers.1.self_attn.qkv_proj"] == [
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj"]
    assert len(units) == 8 and sum(map(len, units.values())) == 14
    # an architecture whose vLLM class fuses only q, k, v (gpt-oss, Qwen3-MoE)
    assert len(fuse(_linears(1), {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})) == 5


def _table(seed: int, units: int = 6) -> dict[str, list[Option]]:
    import random

    rng = random.Random(seed)
    return {f"u{i}": [Option("int4", 25, rng.uniform(0.5, 3.0)),
                      Option("int8", 50, rng.uniform(0.05, 0.4)),
                      Option("bf16", 100, 0.0)] for i in range(units)}


def _brute_force(table: dict[str, list[Option]], budget: int) -> float:
    best = float("inf")
    for combo in itertools.product(*table.values()):
        if sum(o.bytes for o in combo) <= budget:
            best = min(best, sum(o.damage for o in combo))
    return best


@pytest.mark.parametrize("seed, budget", [(0, 150), (1, 200), (2, 330), (3, 425), (4, 600)])
def test_the_solver_finds_the_known_optimum_of_a_synthetic_table(seed, budget):
    table = _table(seed)
    choice = least_damage(table, budget)
    assert choice.bytes <= budget
    assert choice.damage == pytest.approx(_brute_force(table, budget))  # exact, not greedy
    assert set(choice.formats) == set(table)


def test_a_case_where_greedy_by_damage_per_byte_is_wrong():
    # two small units gain most per byte, but the budget is best spent on the big one
    table = {"a": [Option("int4", 10, 1.0), Option("bf16", 20, 0.0)],
             "b": [Option("int4", 10, 1.0), Option("bf16", 20, 0.0)],
             "c": [Option("int4", 10, 2.5), Option("bf16", 30, 0.0)]}
    choice = least_damage(table, 50)
    assert choice.formats == {"a": "int4", "b": "int4", "c": "bf16"}
    assert choice.damage == 2.0


def test_the_smallest_model_within_a_damage_budget():
    table = _table(7)
    choice = fewest_bytes(table, 1.0)
    assert choice.damage <= 1.0 + 1e-9
    best = min(sum(o.bytes for o in combo) for combo in itertools.product(*table.values())
               if sum(o.damage for o in combo) <= 1.0)
    assert choice.bytes == best


def test_a_budget_no_choice_meets_names_the_smallest_that_would():
    table = _table(0)
    with pytest.raises(ConfigError, match="the smallest is 150 bytes") as err:
        least_damage(table, 149)
    assert "BUDGET= at least 150" in str(err.value)
    with pytest.raises(ConfigError, match="the least is 0"):
        fewest_bytes(table, -1.0)
    with pytest.raises(ConfigError, match="lists a format twice"):
        least_damage({"u": [Option("int4", 1, 1.0), Option("int4", 2, 0.5)]}, 10)


def test_the_emitted_recipe_puts_each_unit_in_one_group_and_says_how():
    units = fuse(_linears(2), LLAMA_PACKED)
    formats = {unit: ("int4" if "mlp" in unit else "int8" if "layers.0" in unit else "bf16")
               for unit in units}
    text = searched.recipe_text(Choice(formats, 1234, 0.05), units, "least damage within "
                                "1,234 bytes", 99)
    assert text.startswith("# Searched by qpipe: least damage within 1,234 bytes.")
    data = yaml.safe_load(text)
    # by default the scan's own method: round-to-nearest, data-free
    assert list(data["quantize_stage"]["quantize_modifiers"]) == ["QuantizationModifier"]
    rtn = data["quantize_stage"]["quantize_modifiers"]["QuantizationModifier"]
    assert data["qpipe"]["calibration"] == "none" and data["qpipe"]["search"]["method"] == "rtn"
    groups = {name: set(g["targets"]) for name, g in rtn["config_groups"].items()}
    assert set(groups) == {"group_int4", "group_int8"}
    # fused layers never split: q, k and v of a layer are in the same group (or all ignored)
    for unit, layers in units.items():
        homes = {name for name, targets in groups.items() if set(layers) <= targets}
        ignored = set(layers) <= set(rtn["ignore"])
        assert len(homes) + ignored == 1, unit
    assert "model.layers.1.self_attn.q_proj" in rtn["ignore"]
    assert data["qpipe"]["search"]["predicted_damage"] == 0.05
    gptq = yaml.safe_load(searched.recipe_text(Choice(formats, 1234, 0.05), units, "x", 99,
                                               method="gptq"))
    modifier = gptq["quantize_stage"]["quantize_modifiers"]["GPTQModifier"]
    assert modifier["config_groups"] == rtn["config_groups"] and modifier["ignore"] == rtn[
        "ignore"]
    assert gptq["qpipe"]["calibration"]["dataset"] == searched.CALIBRATION["dataset"]
    with pytest.raises(ConfigError, match="fp4"):
        searched.recipe_text(Choice(dict.fromkeys(units, "fp4"), 1, 0.0), units, "x", 99)
    with pytest.raises(ConfigError, match="METHOD=awq"):
        searched.recipe_text(Choice(formats, 1, 0.0), units, "x", 99, method="awq")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_an_emitted_recipe_quantizes_a_tiny_model_as_chosen(tiny_model: Path, workspace: Path,
                                                            tmp_path: Path, method: str):
    """Each unit in its group; by default the checkpoint is what the scan modelled: its KL
    from the baseline is the scan's for the same choice (round-to-nearest both)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.quantize import baseline as baselines
    from pipeline.quantize import recipes
    from pipeline.quantize import stage as quantize
    from pipeline.search.sensitivity import _Quantized

    units = fuse(_linears(2), LLAMA_PACKED)
    formats = {unit: "int8" if "self_attn" in unit else "int4" if "layers.0" in unit else "bf16"
               for unit in units}
    path = tmp_path / f"searched-{method}.yaml"
    text = searched.recipe_text(Choice(formats, 1, 0.1), units, "a test choice", 99,
                                method=method)
    path.write_text(text.replace("calibration/python-reference.jsonl", str(
        Path(recipes.__file__).resolve().parents[2] / "recipes" / "calibration" /
        "python-reference.jsonl")))
    recipe = recipes.load(str(path)).with_calibration(num_samples=4, max_seq_length=32)
    assert (recipe.calibration is None) == (method == "rtn")  # round-to-nearest: data-free
    base = baselines.resolve(str(tiny_model))
    manifest = quantize.quantize(base, recipe)
    variant = workspace / "artifacts" / "variants" / base.name / recipe.name
    config = json.loads((variant / "config.json").read_text())["quantization_config"]
    assert manifest.format == config["format"] == "mixed-precision"
    bits = {g["weights"]["num_bits"]: set(g["targets"]) for g in config["config_groups"].values()}
    assert bits[8] == {n for n in _linears(2) if "self_attn" in n}
    assert bits[4] == {n for n in _linears(1) if "mlp" in n}
    assert not any("layers.1.mlp" in n for targets in bits.values() for n in targets)
    if method != "rtn":
        return

    def kl(a: torch.Tensor, b: torch.Tensor) -> float:
        pa, pb = torch.log_softmax(a.float(), -1), torch.log_softmax(b.float(), -1)
        return float((pa.exp() * (pa - pb)).sum(-1).mean())

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    checkpoint = AutoModelForCausalLM.from_pretrained(variant, dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (4, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(ids).logits
        with _Quantized(model, {u: layers for u, layers in units.items()}, formats):
            scanned = kl(reference, model(ids).logits)
        stored = kl(reference, checkpoint(ids).logits)
    # the same method: equal up to the checkpoint's bf16 scales (int4 alone: within 0.2%)
    assert scanned > 0 and stored == pytest.approx(scanned, rel=0.1), (stored, scanned)


@pytest.mark.slow
def test_the_scan_measures_each_unit_alone_and_leaves_the_model_as_it_was(tiny_model: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.search.sensitivity import scan

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    windows = [list(range(3, 67)), list(range(100, 164))]
    with torch.inference_mode():
        before = model(torch.tensor([windows[0]])).logits
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and n != "lm_head"]
    units = fuse(names, LLAMA_PACKED)
    seen = []
    table = scan(model, units, ["int4", "int8", "fp8", "bf16"], windows,
                 progress=lambda i, n, damages: seen.append((i, n)))
    assert seen[-1] == (len(units), len(units))
    by = {(d.unit, d.format): d for d in table}
    assert len(by) == 4 * len(units)
    for unit in units:
        int4, int8, fp8, bf16 = (by[unit, f] for f in ("int4", "int8", "fp8", "bf16"))
        assert bf16.kl_div_mean == 0 and bf16.top1_agreement == 1
        assert int4.bytes < int8.bytes == fp8.bytes < bf16.bytes
        assert int4.kl_div_mean > 0 and int8.kl_div_mean >= 0 and fp8.kl_div_mean > 0
    # 4 bits hurt more than 8 (summed over the model: single units can be noise-level)
    assert sum(by[u, "int4"].kl_div_mean for u in units) > 4 * sum(
        by[u, "int8"].kl_div_mean for u in units)
    with torch.inference_mode():
        after = model(torch.tensor([windows[0]])).logits
    assert torch.equal(before, after)  # every layer put back as it was
    assert not any(hasattr(m, "quantization_scheme") for m in model.modules())


# --- the stages: sensitivity table -> budget -> choice -> recipe ---------------------------------
def _sensitivity_table(units: int = 4) -> SensitivityTable:
    layers = {f"model.layers.{i}.{kind}": [f"model.layers.{i}.{kind}"]
              for i in range(units // 2) for kind in ("self_attn.o_proj", "mlp.down_proj")}
    damages = []
    for i, unit in enumerate(layers):
        for fmt, size, kl in (("int4", 30, 0.01 * (i + 1)), ("int8", 55, 0.001 * (i + 1)),
                              ("bf16", 100, 0.0)):
            damages.append(UnitDamage(unit=unit, format=fmt, bytes=size, kl_div_mean=kl,
                                      top1_agreement=1 - kl))
    return SensitivityTable(
        cache_key="k", baseline={"name": "toy"}, architecture="LlamaForCausalLM",
        fusions={}, fusion_source="test", formats=["int4", "int8", "bf16"], units=layers,
        damages=damages, fixed_bytes=200, baseline_weight_bytes=200 + 100 * len(layers),
        text="t", text_sha256="s", tokens=10, method="m", device="cpu", dtype="float32",
        seconds=1.0)


def test_budgets_read_as_bytes_shares_and_multiples_of_a_uniform_format():
    table = _sensitivity_table()  # uniform int4: 200 + 4 x 30 = 320 bytes; baseline 600
    assert budgets.parse("1.25xint4", table)[0] == 400
    assert budgets.parse("50%", table)[0] == budgets.parse("0.5", table)[0] == 300
    assert budgets.parse("1kB", table)[0] == 1000
    assert budgets.parse("1.3e2", table)[0] == 130
    assert budgets.parse("2MiB", table)[0] == 2 * 2**20
    with pytest.raises(ConfigError, match="fp8 is not in the sensitivity table's menu"):
        budgets.parse("1.1xfp8", table)
    with pytest.raises(ConfigError, match="BUDGET=lots: not a budget"):
        budgets.parse("lots", table)
    assert budgets.slug("45%") == "45pct" and budgets.slug("1.15xint4") == "1.15xint4"


def test_the_search_chooses_within_the_budget_over_the_whole_model():
    table = _sensitivity_table()
    choice, how, name = stage.choose(table, SearchSettings(budget="1.25xint4"))
    assert choice.bytes <= 400 and name == "searched-1.25xint4"
    assert "1.25x uniform int4 (320 bytes)" in how
    # 80 bytes above uniform int4 buy three int4 -> int8 upgrades (25 each): the three costliest
    assert sorted(choice.formats.values()) == ["int4", "int8", "int8", "int8"]
    assert choice.formats[next(iter(table.units))] == "int4"  # the least sensitive unit stays
    assert (choice.bytes, choice.damage) == pytest.approx(table.predicted(choice.formats))
    smallest, _, name = stage.choose(table, SearchSettings(max_damage=0.05))
    assert smallest.damage <= 0.05 and name == "searched-kl0.05"
    with pytest.raises(ConfigError, match=r"give one of BUDGET= .* and MAX_DAMAGE=.*, or SPEEDUP="):
        stage.choose(table, SearchSettings(budget="0.9", max_damage=0.1))
    with pytest.raises(ConfigError, match="do not even hold the weights no format changes"):
        stage.choose(table, SearchSettings(budget="150"))
    with pytest.raises(ConfigError, match=r"the smallest is 320 bytes .* BUDGET= at least 320"):
        stage.choose(table, SearchSettings(budget="310"))


def test_the_menu_holds_only_what_vllm_serves_here(monkeypatch: pytest.MonkeyPatch):
    reason = "_C_AVX2 has no cpu_gemm_wna16 (CPUWNA16 kernel) (probe)"
    served = {"int4": (False, reason), "int8": (True, "oneDNN (probe)"),
              "fp8": (True, "a torch scaled-mm path (vLLM 0.32 source)")}
    monkeypatch.setattr(menus, "_support", lambda *args: served)
    host = SimpleNamespace(target="cuda", describe=lambda: "a test host", key=lambda: "test")
    monkeypatch.setattr(menus.hardware, "profile", lambda: host)
    assert menus.resolve(None).formats == ["int8", "fp8", "bf16"]
    # on a CPU, fp8 is served but slowly: asked for by name only
    host.target = "cpu"
    menu = menus.resolve(None)
    assert menu.formats == ["int8", "bf16"] and menu.target.here
    assert set(menu.left_out) == {"int4", "fp8"} and reason in menu.left_out["int4"]
    assert menus.resolve(["int8", "fp8"]).formats == ["int8", "fp8", "bf16"]
    with pytest.raises(ConfigError, match=r"int4: vLLM does not serve it on this machine .*"
                       r"_C_AVX2 has no cpu_gemm_wna16.*TARGET="):
        menus.resolve(["int4", "bf16"])
    with pytest.raises(ConfigError, match="FORMATS=mxfp4: not offered"):
        menus.resolve(["mxfp4"])
    with pytest.raises(ConfigError, match="FORMATS=int3: not a format the search knows"):
        menus.resolve(["int3"])
    assert menus.resolve(["INT8", "int8"]).formats == ["int8", "bf16"]


def test_the_menu_is_the_deployment_targets_not_the_scanning_machines(
        monkeypatch: pytest.MonkeyPatch):
    """On an AVX2-only CPU (no W4A16 kernel) a search for an H100 or an AVX-512 CPU offers
    W4A16; each target's rules are vLLM's, at the preset's compute capability or the CPU
    library's ops."""
    avx2 = {"library": "_C_AVX2", "ops": ["onednn_scaled_mm"]}
    monkeypatch.setattr(menus.doctor, "probe_kernels", lambda prof: avx2)
    here = menus.resolve(None, "cpu-avx2")
    assert here.formats == ["int8", "bf16"] and here.target.here  # this machine's library
    assert "has no cpu_gemm_wna16" in here.left_out["int4"]
    avx512 = menus.resolve(None, "cpu-avx512")
    assert avx512.formats == ["int4", "int8", "bf16"] and not avx512.target.here
    assert "fp8" in avx512.left_out  # served there, but the slowest format on a CPU
    h100 = menus.resolve(None, "h100-80gb")
    assert h100.formats == ["int4", "int8", "fp8", "bf16"] and h100.target.kind == "cuda"
    assert "compute capability 9.0" in h100.target.described
    a100 = menus.resolve(None, "a100-80gb")  # no native FP8 below 8.9: weight-only is not W8A8
    assert a100.formats == ["int4", "int8", "bf16"] and "Marlin" in a100.left_out["fp8"]
    with pytest.raises(ConfigError, match="TARGET=tpu: not a machine the search knows; the "
                       "targets are here, cpu-avx2, cpu-avx512, a100-40gb"):
        menus.resolve(None, "tpu")
    table = _sensitivity_table()
    with pytest.raises(ConfigError, match=r"BUDGET=1.15xfp8: fp8 is not in the menu: .*"
                       r"TARGET=h100-80gb"):
        stage.choose(table, SearchSettings(budget="1.15xfp8"), a100.left_out)
    # refused before any scan is measured for it
    monkeypatch.setattr(stage, "sensitivity", lambda *a, **k: pytest.fail("scanned"))
    with pytest.raises(ConfigError, match=r"BUDGET=1.15xint4: int4 is not in the menu: .*"
                       r"cpu_gemm_wna16.*TARGET=h100-80gb"):
        stage.run_search(SearchSettings(budget="1.15xint4", scan=ScanOptions(target="cpu-avx2")))
    # a byte budget only a left-out format could meet: the same way out, with the reason
    int8_only = table.model_copy(update={
        "formats": ["int8", "bf16"], "damages": [d for d in table.damages if d.format != "int4"]})
    with pytest.raises(ConfigError, match=r"BUDGET=330: no choice of formats fits 330 bytes .*"
                       r"The menu left out int4 \(.*has no cpu_gemm_wna16.*\).*TARGET=h100-80gb"):
        stage.choose(int8_only, SearchSettings(budget="330"), here.left_out)


def test_the_table_is_shown_as_layers_by_unit_kinds(tmp_path: Path):
    table = _sensitivity_table()
    text = tables.render(table)
    assert "int4: KL x 1e-3 per unit" in text and "o_proj" in text and "down_proj" in text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert rows[0][:3] == ["0", "10.000", "20.000"]  # layer 0: o_proj, down_proj at int4
    assert "most sensitive: model.layers.1.mlp.down_proj 0.0400" in text
    assert tables.heatmap(table, tmp_path / "h.png").stat().st_size > 1000


@pytest.mark.serve
def test_sensitivity_and_search_on_a_tiny_model_give_a_recipe_whose_bytes_are_as_predicted(
        tiny_model: Path, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture):
    from pipeline.quantize import baseline as baselines
    from pipeline.quantize import recipes
    from pipeline.quantize import stage as quantize
    from pipeline.search.settings import ScanOptions, SensitivitySettings

    # the default menu: what vLLM serves here (an AVX2-only CPU has no W4A16 kernel)
    scan_options = ScanOptions(scan_tokens=64)
    table = stage.sensitivity(SensitivitySettings(baseline=str(tiny_model), scan=scan_options))
    assert table.formats == menus.resolve(None).formats and "int8" in table.formats
    assert len(table.units) == 8
    assert table.fusions["qkv_proj"] == ["q_proj", "k_proj", "v_proj"]  # read from vLLM
    small = "int4" if "int4" in table.formats else "int8"
    assert table.uniform(small)[1] > 0 and table.uniform(small)[0] < table.uniform("bf16")[0]
    if small == "int4":
        assert table.uniform("int4")[1] > table.uniform("int8")[1]
    again = stage.sensitivity(SensitivitySettings(baseline=str(tiny_model), scan=scan_options))
    assert again == table  # cached by content: nothing measured twice
    shown = SensitivityTable.root(table.baseline["name"]) / "+".join(table.formats)
    assert (shown / "sensitivity.png").is_file() and (shown / "sensitivity.txt").is_file()

    recipes_dir = tmp_path / "recipes"
    (recipes_dir / "calibration").mkdir(parents=True)
    (recipes_dir / "calibration" / "python-reference.jsonl").write_text(
        (paths.CALIBRATION_DIR / "python-reference.jsonl").read_text())
    monkeypatch.setattr(paths, "RECIPES_DIR", recipes_dir)
    budget = f"1.3x{small}"
    path = stage.run_search(SearchSettings(baseline=str(tiny_model), budget=budget,
                                           scan=scan_options))
    assert path == recipes_dir / f"searched-{budget}.yaml"
    block = yaml.safe_load(path.read_text())["qpipe"]["search"]
    assert table.uniform(small)[0] < block["weight_bytes"] <= 1.3 * table.uniform(small)[0]
    assert block["sensitivity"] == table.cache_key
    (recipes_dir / "int4.yaml").write_text((paths.PROJECT_ROOT / "recipes/int4.yaml").read_text())
    with pytest.raises(ConfigError, match="a recipe that was not searched"):
        stage.run_search(SearchSettings(baseline=str(tiny_model), budget=budget,
                                        name="int4", scan=scan_options))

    # the second pass: re-scored in the first choice's context, its prediction measured at once
    again = yaml.safe_load(stage.run_search(SearchSettings(
        baseline=str(tiny_model), budget=budget, scan=scan_options, refine=True,
        name="refined")).read_text())["qpipe"]["search"]
    assert "measured at once" in again["refined"] and again["weight_bytes"] <= 1.3 * \
        table.uniform(small)[0]
    recipe = recipes.load(str(path)).with_calibration(num_samples=4, max_seq_length=32)
    manifest = quantize.quantize(baselines.resolve(str(tiny_model)), recipe)
    # the byte model the solver used is the checkpoint's: predicted = stored, to 1%
    assert manifest.weight_bytes == pytest.approx(block["weight_bytes"], rel=0.01)
    quantized = {fmt for fmt, n in block["units"].items() if n and fmt != "bf16"}
    assert (manifest.format == "mixed-precision") == (len(quantized) > 1)


def test_a_recipe_searched_for_one_baseline_is_refused_for_another(tmp_path: Path):
    from pipeline.quantize import recipes
    from pipeline.quantize.stage import quantize

    units = fuse(_linears(1), LLAMA_PACKED)
    text = searched.recipe_text(Choice(dict.fromkeys(units, "int8"), 1, 0.1), units, "a test",
                                99, extra={"baseline": "other", "baseline_identity": "abc123"})
    path = tmp_path / "searched-x.yaml"
    path.write_text(text)
    recipe = recipes.load(str(path))
    assert recipe.searched_for == "abc123"

    class Base:
        name, identity, source = "tiny", "def456", "/models/tiny"
    with pytest.raises(RecipeError, match=r"made for another baseline .* `make search "
                       r"BASELINE=/models/tiny"):
        quantize(Base(), recipe)  # type: ignore[arg-type]


def test_a_campaign_of_every_recipe_leaves_out_one_searched_for_another_baseline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from pipeline.campaign import runner as campaign

    units = fuse(_linears(1), LLAMA_PACKED)
    (tmp_path / "int4.yaml").write_text((paths.RECIPES_DIR / "int4.yaml").read_text())
    for name, identity in (("searched-mine", "def456"), ("searched-other", "abc123")):
        (tmp_path / f"{name}.yaml").write_text(searched.recipe_text(
            Choice(dict.fromkeys(units, "int8"), 1, 0.1), units, "a test", 99,
            extra={"baseline_identity": identity}))
    monkeypatch.setattr(paths, "RECIPES_DIR", tmp_path)
    settings = campaign.CampaignSettings(baseline="tiny", track=False)
    file = settings.file().model_copy(update={"recipes": ()})
    base = SimpleNamespace(name="tiny", identity="def456")
    quantize, _, evaluate = campaign.stages(settings, file, base)  # type: ignore[arg-type]
    assert [q.recipe for q in quantize] == ["int4", "searched-mine"]
    assert evaluate.recipes == ("int4", "searched-mine")
    assert len(campaign.stages(settings, file)[0]) == 3  # without a baseline: every recipe


def test_a_searched_recipe_says_how_the_predictions_have_held(workspace: Path):
    """The newest comparison's measured against predicted KL, per variant, goes into every
    searched recipe (and MAX_DAMAGE= trusts a prediction only as far as these held)."""
    from pipeline.core.artifacts import Comparison, PlanTarget, Prediction, Row

    assert measured.predictions_held("Tiny") == ""

    def row(name: str, predicted: float, measured: float | None,
            uniform: bool = False) -> Row:
        found = Row(name=name, recipe=name, scheme="S", format="f", precision="p",
                    weight_bytes=1, weight_ratio=0.5,
                    search=Prediction(predicted_kl=predicted, basis="test", uniform=uniform))
        if measured is not None:
            found.divergence = {"kl_div_mean": measured}
        return found

    comparison = Comparison(baseline="Tiny", workload="", load_point=None,
                            plan_target=PlanTarget(), recommendation=None, reason="",
                            rows=[row("s1", 0.4, 0.6), row("s", 0.2, 0.22),
                                  row("int8", 0.1, None),
                                  row("int4", 0.4, 0.56, uniform=True)],
                            meta={"created": "2026-12-02"})
    comparison.write(Comparison.directory("Tiny") / Comparison.FILE)
    # a shipped uniform recipe is GPTQ, not the search's method: not one of its predictions
    assert measured.predictions_held("Tiny") == (
        "1 of 2 predictions held (measured within 0.75-1.33x of predicted, or within 0.002 "
        "nats/token) in the newest comparison (2026-12-02): s1 1.50x, s 1.10x")


def test_the_prediction_is_calibrated_by_the_uniform_variants_measured_damage(workspace: Path):
    """The scan is round-to-nearest, the checkpoints GPTQ: each format's summed damages are
    scaled by its uniform variant's measured/predicted KL, so the solver weighs formats by
    what they measured, and the recipe's predicted damage is the calibrated one."""
    from pipeline.core.artifacts import Comparison, PlanTarget, Prediction, Row

    table = _sensitivity_table()  # int4 damages 0.01-0.04 (sum 0.1), int8 0.001-0.004
    assert measured.calibration(table) == ({}, "not calibrated: no comparison of this baseline "
                                            "yet")

    def uniform(fmt: str, measured: float, predicted_then: bool = True, name: str = "",
                group: int | None = None, symmetric: bool = True) -> Row:
        predicted = table.uniform(fmt)[1]
        return Row(name=name or fmt, recipe=name or fmt, scheme="S", format="f", precision=fmt,
                   group_size=group if group or fmt != "int4" else 64, symmetric=symmetric,
                   weight_bytes=1, weight_ratio=0.5,
                   divergence={"kl_div_mean": measured * predicted},
                   search=Prediction(predicted_kl=predicted, basis="every unit at " + fmt)
                   if predicted_then else None)

    # a comparison made before the scan holds no prediction: the table's own is used; a row
    # is matched to a format by what its checkpoint is, not its name: AWQ's asymmetric
    # group-128 INT4 is not the scan's int4, and a recipe named otherwise may be
    Comparison(baseline="toy", workload="", load_point=None, plan_target=PlanTarget(),
               recommendation=None, reason="",
               rows=[uniform("int4", 99, name="awq", group=128, symmetric=False),
                     uniform("int4", 1.5, predicted_then=False, name="w4-g64"),
                     uniform("int8", 20)],
               meta={"created": "2026-12-02"}).write(
        Comparison.directory("toy") / Comparison.FILE)
    factors, how = measured.calibration(table)
    assert factors == {"int4": 1.5, "int8": 20.0}
    assert "int4 1.50x, int8 20.00x" in how and "(2026-12-02)" in how
    settings = SearchSettings(budget="420")  # 220 bytes for 4 units: e.g. 2 x int8 + 2 x int4
    raw, _, _ = stage.choose(table, settings)
    calibrated, _, _ = stage.choose(table, settings, factors=factors)
    assert raw.damage == pytest.approx(table.predicted(raw.formats)[1])
    # int8 measured 20x its scan here: the calibrated choice trades it for int4 where it can
    assert sum(f == "int8" for f in calibrated.formats.values()) < sum(
        f == "int8" for f in raw.formats.values())
    assert calibrated.damage == pytest.approx(sum(
        table.damage(u, f).kl_div_mean * factors.get(f, 1.0)
        for u, f in calibrated.formats.items()))


@pytest.mark.slow
def test_units_rescored_in_a_mixes_context_are_that_mixes_own_damages(tiny_model: Path):
    """The mix's whole-model KL is measured at once; a unit's damage in its context is the mix
    with that unit changed, minus the mix; the model is left as it was."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.search import sensitivity

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    linears = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    units = fuse(linears, {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                           "gate_up_proj": ["gate_proj", "up_proj"]})
    windows = [list(range(1, 65)), list(range(100, 164))]
    before = sensitivity._log_probs(model, windows)
    one = next(iter(units))
    only = {u: ("int4" if u == one else "bf16") for u in units}
    mix, context = sensitivity.in_context(model, units, ["int4", "int8", "bf16"], only,
                                          windows)
    assert mix == pytest.approx(sensitivity.whole_damage(model, units, only, windows))
    assert mix > 0
    damages = {(d.unit, d.format): d.kl_div_mean for d in context}
    assert damages[(one, "int4")] == 0.0  # its format in the mix: no change
    assert damages[(one, "bf16")] == pytest.approx(-mix, abs=1e-6)  # the mix's only damage
    other = next(u for u in units if u != one)
    both = sensitivity.whole_damage(model, units, {**only, other: "int4"}, windows)
    assert damages[(other, "int4")] == pytest.approx(both - mix, abs=1e-6)
    after = sensitivity._log_probs(model, windows)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_speed_budget_steers_away_from_formats_that_measured_slow(workspace: Path):
    """SPEEDUP=: the least damage whose predicted throughput clears the target at the low ends
    of the uniform variants' measured speedups (as on vLLM CPU: int8 faster, fp8 ten times
    slower); a target no mix reaches so names the fastest one and the target it reaches."""
    from pipeline.core.artifacts import Comparison, PlanTarget, Row

    table = _sensitivity_table()  # units of 100 bf16 bytes each: a quarter of the time each
    table = table.model_copy(update={"formats": ["int4", "int8", "fp8", "bf16"], "damages": [
        *table.damages, *[UnitDamage(unit=u, format="fp8", bytes=55, kl_div_mean=0.0005,
                                     top1_agreement=1.0) for u in table.units]]})
    with pytest.raises(ConfigError, match="no uniform variant's speed is measured"):
        stage.choose(table, SearchSettings(speedup=1.05))

    def served(name: str, speedup: float | None, low: float = 0, high: float = 0) -> Row:
        return Row(name=name, recipe=name, scheme="S", format="f", precision=name,
                   weight_bytes=1, weight_ratio=0.5, serving="ok" if speedup else "unsupported",
                   headline={"speedup": speedup, "speedup_ci_low": low,
                             "speedup_ci_high": high} if speedup else {})

    Comparison(baseline="toy", workload="chat", load_point=4, plan_target=PlanTarget(),
               recommendation=None, reason="", hardware="a test CPU",
               measurement={"hardware_key": "cpu-avx2"},
               rows=[served("int8", 1.25, 1.15, 1.36), served("fp8", 0.1, 0.08, 0.12),
                     served("int4", None)]).write(Comparison.directory("toy") / Comparison.FILE)
    # speeds measured on an AVX2 CPU are not an H100's: a speed budget for it is refused
    h100 = menus.Target("h100-80gb", "cuda", "NVIDIA H100 80GB (compute capability 9.0)",
                        False, hardware="-sm90")
    with pytest.raises(ConfigError, match=r"SPEEDUP=1.05: .* measured on cpu-avx2 \(a test "
                       r"CPU\), not on NVIDIA H100 .*machine the recipe is for"):
        stage.choose(table, SearchSettings(speedup=1.05), target=h100)
    avx2 = menus.Target("cpu-avx2", "cpu", "cpu-avx2", True, hardware="cpu-avx2")
    assert measured.speeds(table, avx2)[0] == measured.speeds(table)[0]
    assert h100.measures("cuda-nvidia-h100-80gb-hbm3-sm90-80g") and not h100.measures("")
    assert avx2.measures("cpu-avx2+amx") and not avx2.measures("cpu-avx512bf16")
    speed, basis = measured.speeds(table)
    assert speed == {"bf16": measured.Speed(1.0, 1.0, 1.0),
                     "int8": measured.Speed(1.25, 1.15, 1.36),
                     "fp8": measured.Speed(0.1, 0.08, 0.12)}
    assert "chat concurrency 4" in basis and "a test CPU" in basis
    assert "int8 1.25x [1.15, 1.36]" in basis
    # least damage alone would take fp8 everywhere (0.0005 a unit); at >= 1.1x it cannot
    choice, how, name = stage.choose(table, SearchSettings(speedup=1.1))
    assert "fp8" not in choice.formats.values() and "int4" not in choice.formats.values()
    predicted = measured.mix_speedup(choice.formats, table, speed)
    # the budget holds at the low ends, so the point is above it
    assert predicted.low >= 1.1 and 1 / choice.time == pytest.approx(predicted.low, abs=1e-3)
    assert predicted.point > predicted.low and predicted.high > predicted.point
    assert name == "searched-1.1x" and "at the low ends" in how
    assert "int4 left out: not served and measured there" in how
    # every unit at int8 is the fastest mix: 1.25x at the point, 1.15x at the low end; 1.2x
    # (below its point) is refused, and the reachable target named
    fastest = measured.mix_speedup(dict.fromkeys(table.units, "int8"), table, speed)
    assert fastest == measured.Speed(1.25, 1.15, 1.36)
    with pytest.raises(ConfigError, match=r"SPEEDUP=1.2: no mix .* every unit at its fastest "
                       r"format \(int8\), is predicted 1.25x \[1.15, 1.36\]\. Reachable: "
                       r"SPEEDUP=1.15"):
        stage.choose(table, SearchSettings(speedup=1.2))
    # beside a memory budget: both hold
    both, _, _ = stage.choose(table, SearchSettings(speedup=1.05, budget="430"))
    assert both.bytes <= 430 and 1 / both.time >= 1.05


def test_units_kept_unquantized_run_at_the_checkpoints_own_dtype(workspace: Path):
    """On a CPU without bf16 units the reference is the baseline in float32, but a variant's
    unquantized layers run in its own bf16: a bf16 unit is not 1x, it is the probe's bf16
    against float32 (4.18x [2.85, 6.12] inverted), and a target no mix then reaches says so."""
    from pipeline.core.artifacts import Comparison, PlanTarget, Row
    from pipeline.report.reference import own_dtype_speedup

    probe = {"point": 4.0, "low": 2.5, "high": 5.0}
    ref = SimpleNamespace(reference={"dtype": "float32", "probe": {"float32_vs_bf16": probe}})
    own = own_dtype_speedup(ref)  # type: ignore[arg-type]
    assert own == {"point": 0.25, "low": 0.2, "high": 0.4}
    assert own_dtype_speedup(SimpleNamespace(reference={"dtype": "bfloat16"})) == {}  # type: ignore[arg-type]
    table = _sensitivity_table()
    Comparison(baseline="toy", workload="chat", load_point=8, plan_target=PlanTarget(),
               recommendation=None, reason="", hardware="an AVX2 CPU",
               measurement={"hardware_key": "cpu-avx2"}, own_dtype_speedup=own,
               rows=[Row(name="int8", recipe="int8", scheme="S", format="f", precision="int8",
                         weight_bytes=1, weight_ratio=0.5, serving="ok",
                         headline={"speedup": 0.55, "speedup_ci_low": 0.4,
                                   "speedup_ci_high": 0.75})]
               ).write(Comparison.directory("toy") / Comparison.FILE)
    speed, basis = measured.speeds(table)
    assert speed["bf16"] == measured.Speed(0.25, 0.2, 0.4)
    assert "bf16 units at 0.25x [0.20, 0.40], the baseline in its own dtype" in basis
    # every unit at int8 is the fastest mix, 0.55x [0.40, 0.75]: far from 1x, not 1x at bf16
    with pytest.raises(ConfigError, match=r"fastest format \(int8\), is predicted 0.55x "
                       r"\[0.40, 0.75\]\. Reachable: SPEEDUP=0.4"):
        stage.choose(table, SearchSettings(speedup=0.9))


def test_a_recipe_searched_for_another_machine_says_so_on_its_row():
    """The report's row of a searched variant names the target it was searched for, and that
    the figures shown are this machine's."""
    from pipeline.core.artifacts import Row
    from pipeline.report.accuracy import apply_search

    def row() -> Row:
        return Row(name="searched-1.15xint4-h100-80gb", recipe="searched-1.15xint4-h100-80gb",
                   scheme="S", format="mixed-precision", precision="mixed", weight_bytes=1,
                   weight_ratio=0.5)

    found = {"predicted_damage": 0.104, "weight_bytes": 130, "how": "least predicted damage",
             "target": "h100-80gb", "target_described": "NVIDIA H100 80GB (compute capability "
                                                       "9.0, from vLLM's kernel rules)"}
    far = row()
    apply_search(far, found, [])
    assert far.search is not None and far.search.predicted_kl == pytest.approx(0.104)
    (note,) = far.notes
    assert note.startswith("searched for NVIDIA H100 80GB") and "scored emulated" in note
    assert "this machine's, not the target's" in note
    near = row()
    apply_search(near, {**found, "target": "here"}, [])
    assert near.notes == []

"""``qpipe sensitivity`` (``make sensitivity``) and ``qpipe search`` (``make search``).

sensitivity: baseline -> units (vLLM's fusions) -> each unit alone in each format of the menu
-> ``artifacts/sensitivity/<baseline>/<menu>/`` (JSON, text table, heat-map) + an MLflow run;
cached by the baseline's content, the menu, the text and the libraries.
search: that table -> the exact solver under ``BUDGET=`` (or ``MAX_DAMAGE=``) ->
``recipes/<name>.yaml``, an ordinary llmcompressor recipe every other stage takes as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core import hardware, heldout, paths, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import SensitivityTable, UnitDamage
from pipeline.core.errors import ConfigError
from pipeline.core.fsutil import atomic_dir
from pipeline.core.provenance import content_key, library_versions
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint, recipes
from pipeline.search import budget as budgets
from pipeline.search import measured
from pipeline.search import menu as menus
from pipeline.search import recipe as searched
from pipeline.search import table as tables
from pipeline.search.sensitivity import (
    FORMATS,
    Damage,
    in_context,
    scan,
    unit_bytes,
    whole_damage,
)
from pipeline.search.settings import SearchSettings, SensitivitySettings
from pipeline.search.solver import Choice, Option, fewest_bytes, least_damage
from pipeline.search.units import fuse
from pipeline.serve.fusions import packed_modules

log = qlog.get("search")
METHOD = ("round-to-nearest with compressed-tensors' schemes and llmcompressor's observers, "
          "one unit at a time; cpu: float32, cuda: bf16")
SENSITIVITY, SEARCH = "sensitivity", "search"
TEXT_FILE, PLOT_FILE = "sensitivity.txt", "sensitivity.png"


def _table_dir(baseline_name: str, formats: list[str]) -> Path:
    return SensitivityTable.root(baseline_name) / SensitivityTable.menu_name(formats)


def _architecture(base: baselines.Baseline) -> str:
    config = json.loads((base.path / "config.json").read_text())
    archs = config.get("architectures") or []
    if not archs:
        raise ConfigError(f"{base.path / 'config.json'}: no `architectures` entry, so the "
                          "layers vLLM fuses cannot be looked up. Fix: add the model class, "
                          "e.g. [\"LlamaForCausalLM\"].")
    return str(archs[0])


def _cache_key(base: baselines.Baseline, formats: list[str], text: str, tokens: int,
               fusions: dict[str, list[str]]) -> str:
    payload = {"baseline": base.identity, "formats": formats,
               "schemes": {f: FORMATS.get(f) for f in formats}, "text": heldout.text_hash(text),
               "tokens": tokens, "fusions": fusions, "libraries": library_versions(),
               "method": METHOD, "device": hardware.torch_device()}
    return content_key(payload)


def _load(base: baselines.Baseline) -> tuple[Any, str]:
    import torch
    from transformers import AutoModelForCausalLM

    if hardware.torch_device() == "cuda":
        dtype = torch.bfloat16  # accelerate spreads a large model over every GPU
        model = AutoModelForCausalLM.from_pretrained(base.path, dtype=dtype, device_map="auto")
    else:
        dtype = torch.float32  # ~3x faster than bf16 on CPUs without bf16 units
        model = AutoModelForCausalLM.from_pretrained(base.path, dtype=dtype)
    return model.eval(), str(dtype).removeprefix("torch.")


def _progress(started: float) -> Any:
    def report(done: int, total: int, damages: list[Damage]) -> None:
        left = (time.monotonic() - started) / done * (total - done)
        figures = ", ".join(f"{d.format} {d.kl_div_mean:.5f}" for d in damages
                            if d.format != searched.KEEP)
        log.info(f"[{done}/{total}] {damages[0].unit}: KL {figures} (~{left / 60:.1f} min left)")
    return report


def _scan_ids(base: baselines.Baseline, text: str, tokens: int) -> list[int]:
    """The scan's part of the held-out text, as the baseline's tokenizer reads it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base.path)
    return heldout.scan_part(tokenizer(text, add_special_tokens=True).input_ids, tokens)


@contextlib.contextmanager
def _every_core() -> Iterator[None]:
    """Torch on every core of a CPU for a scan's forward passes, as it was after."""
    import torch

    threads = torch.get_num_threads()
    if hardware.torch_device() == "cpu":
        torch.set_num_threads(os.cpu_count() or threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sensitivity(settings: SensitivitySettings, menu: menus.Menu | None = None
                ) -> SensitivityTable:
    """The table for ``settings`` (measured, or the cached one when nothing changed). The
    damages do not depend on the target, only the menu does: one table per menu."""
    import torch

    base = baselines.resolve(settings.baseline)
    menu = menu or menus.resolve(settings.scan.formats, settings.scan.target)
    formats = menu.formats
    log.info(f"menu for {menu.target.described}: {', '.join(formats)}")
    architecture = _architecture(base)
    fusions, fusion_source = packed_modules(architecture)
    text = heldout.heldout_text()
    key = _cache_key(base, formats, text, settings.scan.scan_tokens, fusions)
    target = _table_dir(base.name, formats)
    table = SensitivityTable.read(target / SensitivityTable.FILE)
    if table is not None and table.cache_key == key and not settings.force:
        log.info(f"the sensitivity table of {base.name} for {', '.join(formats)} is up to date "
                 f"({target}); nothing to do (FORCE=1 redoes it).")
        _track_table(base, table, target)
        return table
    ids = _scan_ids(base, text, settings.scan.scan_tokens)
    windows = heldout.windows(ids)
    model, dtype = _load(base)
    linears = [name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    units = fuse(linears, fusions)
    named = dict(model.named_modules())
    in_units = sum(unit_bytes([named[n] for n in units[u]], searched.KEEP) for u in units)
    baseline_bytes = checkpoint.measure(base.path).weight_bytes
    log.info(f"{base.name}: {len(units)} units ({len(linears)} linear layers; fused as "
             f"{fusion_source}) x {', '.join(formats)} on {len(ids)} held-out tokens, on "
             f"{hardware.torch_device_name()} in {dtype}")
    started = time.monotonic()
    with _every_core():
        damages = scan(model, units, formats, windows, progress=_progress(started))
    table = SensitivityTable(
        cache_key=key, baseline=base.as_dict(), architecture=architecture, fusions=fusions,
        fusion_source=fusion_source, formats=formats, units=units,
        damages=[UnitDamage(unit=d.unit, format=d.format, bytes=d.bytes,
                            kl_div_mean=d.kl_div_mean, top1_agreement=d.top1_agreement)
                 for d in damages],
        fixed_bytes=baseline_bytes - in_units, baseline_weight_bytes=baseline_bytes,
        text=str(paths.relative(heldout.HELDOUT)), text_sha256=heldout.text_hash(text),
        tokens=len(ids), method=METHOD, device=hardware.torch_device_name(), dtype=dtype,
        seconds=round(time.monotonic() - started, 1), libraries=library_versions())
    with atomic_dir(target) as tmp:
        table.write(tmp / SensitivityTable.FILE)
        (tmp / TEXT_FILE).write_text(tables.render(table) + "\n")
        tables.heatmap(table, tmp / PLOT_FILE)
    log.info(f"wrote {target} in {table.seconds / 60:.1f} min")
    _track_table(base, table, target)
    return table


def _track_table(base: baselines.Baseline, table: SensitivityTable, target: Path) -> None:
    if tracking.find_run(base.name, SENSITIVITY, table.cache_key):
        return
    metrics: dict[str, float] = {"units": len(table.units), "scan_seconds": table.seconds,
                                 "scan_tokens": table.tokens}
    stepped = []
    for fmt in table.formats:
        size, damage = table.uniform(fmt)
        metrics[f"uniform_{fmt}_weight_bytes"] = size
        metrics[f"uniform_{fmt}_predicted_kl"] = damage
        stepped += [(f"kl_{fmt}", table.damage(unit, fmt).kl_div_mean, i)
                    for i, unit in enumerate(table.units)]
    tracking.log_run(
        base.name, SENSITIVITY, f"sensitivity:{SensitivityTable.menu_name(table.formats)}",
        params={tracking.PARAM_BASELINE: base.name, "formats": ",".join(table.formats),
                "architecture": table.architecture, "fusions": json.dumps(table.fusions),
                "text": table.text, "method": table.method, "device": table.device},
        metrics=metrics, stepped=stepped,
        tags={tracking.TAG_CACHE_KEY: table.cache_key},
        artifacts=[target / SensitivityTable.FILE, target / TEXT_FILE, target / PLOT_FILE])


def run_sensitivity(settings: SensitivitySettings) -> SensitivityTable:
    """``make sensitivity``: measure (or reuse) the table and print it."""
    table = sensitivity(settings)
    print(tables.render(table))
    target = _table_dir(table.baseline["name"], table.formats)
    print(f"\nheat-map: {target / PLOT_FILE}\ntable: {target / SensitivityTable.FILE}")
    return table


def options(table: SensitivityTable, factors: dict[str, float] | None = None
            ) -> dict[str, list[Option]]:
    """The solver's table: unit -> one option per format of the menu, each damage times its
    format's calibration factor (1 where there is none)."""
    factors = factors or {}
    return {unit: [Option(d.format, d.bytes, d.kl_div_mean * factors.get(d.format, 1.0))
                   for d in table.damages if d.unit == unit] for unit in table.units}


def choose(table: SensitivityTable, settings: SearchSettings,
           left_out: dict[str, str] | None = None, factors: dict[str, float] | None = None,
           opts: dict[str, list[Option]] | None = None, offset: float = 0.0,
           target: menus.Target | None = None) -> tuple[Choice, str, str]:
    """(the choice with totals over the whole model, how it was chosen, the default name);
    ``left_out``: the formats the menu left out, and why; ``factors``: each format's
    calibration (the damages the solver weighs and the prediction are calibrated); ``opts``
    and ``offset``: other options (damages re-scored in a mix's context, which ``offset``, the
    mix's own damage, is added to); ``target``: the machine a speed budget's speeds must have
    been measured on."""
    opts = opts or options(table, factors)
    if (settings.budget is not None and settings.max_damage is not None) or not (
            settings.budget or settings.max_damage is not None or settings.speedup):
        raise ConfigError("give one of BUDGET= (weight memory, e.g. 1.15xint4 or 130MB) and "
                          "MAX_DAMAGE= (summed KL, e.g. 0.05), or SPEEDUP= (e.g. 1.2), or "
                          "SPEEDUP= with one of them.")
    fixed = table.fixed_bytes
    max_time, fast = None, ""
    if settings.speedup:
        speed, basis = measured.speeds(table, target)
        missing = [f for f in table.formats if f not in speed]
        if len(speed) < 2:
            raise ConfigError(f"SPEEDUP={settings.speedup:g}: no uniform variant's speed is "
                              f"measured to predict a mix's from: {basis}. Fix: make all "
                              "RECIPE=\"int4 int8\" on the machine the recipe is for, and "
                              "search there (or a memory budget alone: BUDGET=, MAX_DAMAGE=).")
        # the budget holds at the low ends of the uniform speedups' intervals: a mix chosen
        # at their points would miss it about half the time
        opts = measured.timed(opts, table, {f: s.low for f, s in speed.items()})
        max_time = 1 / settings.speedup
        _speed_reachable(opts, table, speed, settings.speedup, basis)
        fast = (f", predicted >= {settings.speedup:g}x the baseline's throughput at the low "
                f"ends of the uniform variants' measured speedups ({basis})"
                + (f"; {', '.join(missing)} left out: not served and measured there"
                   if missing else ""))
    if settings.budget is None and settings.max_damage is None:
        return (least_damage(opts, math.inf, fixed, max_time),
                f"least predicted damage{fast}", f"searched-{settings.speedup:g}x")
    if settings.budget is not None:
        limit, reads = budgets.parse(settings.budget, table, left_out)
        if limit <= fixed:
            raise ConfigError(f"BUDGET={settings.budget}: {limit:,} bytes do not even hold the "
                              f"weights no format changes ({fixed:,} bytes: embeddings, norms).")
        how = f"least predicted damage within {reads} = {limit:,} bytes of weights{fast}"
        try:
            found = least_damage(opts, limit, fixed, max_time)
        except ConfigError as err:
            raise budgets.unmet(settings.budget, str(err), left_out) from None
        return found, how, f"searched-{budgets.slug(settings.budget)}"
    damage = float(settings.max_damage or 0)
    return (fewest_bytes(opts, damage - offset, fixed, max_time),
            f"fewest weight bytes with predicted damage <= {damage:g}{fast}",
            f"searched-kl{damage:g}")


def _speed_reachable(opts: dict[str, list[Option]], table: SensitivityTable,
                     speed: dict[str, measured.Speed], target: float, basis: str) -> None:
    """Refuse a speed budget no mix meets at the uniform speedups' low ends, naming the
    fastest mix's prediction and the budget it does meet."""
    fastest = {unit: min(unit_opts, key=lambda o: o.time).format
               for unit, unit_opts in opts.items()}
    best = measured.mix_speedup(fastest, table, speed)
    if best.low >= target - 1e-9:
        return
    formats = ", ".join(sorted(set(fastest.values())))
    raise ConfigError(
        f"SPEEDUP={target:g}: no mix is predicted at least {target:g}x at the low ends of the "
        f"uniform variants' measured speedups ({basis}); the fastest, every unit at its "
        f"fastest format ({formats}), is predicted {best.text()}. Reachable: SPEEDUP="
        f"{math.floor(best.low * 100 + 1e-6) / 100:g}, or narrow the uniform variants' intervals "
        "(make all RECIPE=\"int4 int8\" REPEATS=12) and search again.")


def _refine(table: SensitivityTable, settings: SearchSettings, first: Choice,
            left_out: dict[str, str], target: menus.Target) -> tuple[Choice, str]:
    """The second pass: every unit re-scored in the context of the first choice (its marginal
    damage in that mix, round-to-nearest, on the scan's text), the choice re-solved with those,
    and its prediction the re-solved mix's whole-model KL, measured at once (no additivity
    assumed). About as long as the scan."""
    base = baselines.resolve(settings.baseline)
    model, _ = _load(base)
    windows = heldout.windows(_scan_ids(base, heldout.heldout_text(), table.tokens))
    log.info(f"re-scoring {len(table.units)} units in the context of the first choice "
             f"({first.damage:.4f} predicted)")
    with _every_core():
        mix, context = in_context(model, table.units, table.formats, first.formats, windows,
                                  progress=_progress(time.monotonic()))
    opts = {unit: [Option(d.format, d.bytes, d.kl_div_mean) for d in context if d.unit == unit]
            for unit in table.units}
    again, _, _ = choose(table, settings, left_out, opts=opts, offset=mix, target=target)
    with _every_core():
        whole = whole_damage(model, table.units, again.formats, windows)
    changed = sum(again.formats[u] != first.formats[u] for u in table.units)
    return (Choice(again.formats, again.bytes, whole),
            f"the re-solved mix's whole-model KL, round-to-nearest on the scan's text, measured "
            f"at once: {whole:.4f} (the first choice's summed damages {first.damage:.4f}, "
            f"its whole-model KL {mix:.4f}; {changed} unit(s) changed)")


def run_search(settings: SearchSettings) -> Path:
    """``make search``: the table (measured if needed), the choice, ``recipes/<name>.yaml``."""
    menu = menus.resolve(settings.scan.formats, settings.scan.target)
    if settings.budget is not None:
        budgets.check_menu(settings.budget, menu.left_out)
    table = sensitivity(SensitivitySettings(baseline=settings.baseline, scan=settings.scan), menu)
    if settings.method == searched.RTN:
        factors, calibrated = {}, ("the damages as scanned: the checkpoint is quantized by the "
                                   "scan's own method (round-to-nearest; METHOD=gptq for GPTQ)")
    elif settings.calibrate:
        factors, calibrated = measured.calibration(table)
    else:
        factors, calibrated = {}, "not calibrated (--no-calibrate)"
    choice, how, default_name = choose(table, settings, menu.left_out, factors,
                                       target=menu.target)
    refined = ""
    if settings.refine:
        choice, refined = _refine(table, settings, choice, menu.left_out, menu.target)
        how += ", re-solved with each unit re-scored in the first choice's context"
    raw = table.predicted(choice.formats)[1]
    if not menu.target.here:
        how += f", for {menu.target.name}"
        default_name += f"-{menu.target.name}"
    name = settings.name or default_name
    path = paths.RECIPES_DIR / f"{name}.yaml"
    if path.exists() and not recipes.load(str(path)).search:
        raise ConfigError(f"{path} is a recipe that was not searched; it is left as it is. "
                          "Fix: NAME= another name.")
    counts = {fmt: sum(1 for f in choice.formats.values() if f == fmt) for fmt in table.formats}
    # a speed budget's prediction: at the uniform speedups' points and their intervals' ends
    fast = measured.mix_speedup(choice.formats, table, measured.speeds(table, menu.target)[0]) \
        if settings.speedup else None
    record = measured.predictions_held(table.baseline["name"]) or (
        "no searched or uniform variant of this baseline measured against its prediction yet "
        "(make all RECIPE=\"int4 int8 ...\")")
    text = searched.recipe_text(choice, table.units, how, settings.threshold, extra={
        "baseline": table.baseline["name"], "baseline_identity": table.baseline["identity"],
        "sensitivity": table.cache_key, "units": counts, "scan_tokens": table.tokens,
        "target": menu.target.name, "target_described": menu.target.described,
        "predictions_held": record, "calibration": calibrated,
        "predicted_damage_as_scanned": round(raw, 6),
        **({"predicted_speedup": fast.point, "predicted_speedup_low": fast.low,
            "predicted_speedup_high": fast.high} if fast else {}),
        **({"refined": refined} if refined else {})}, method=settings.method)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    recipes.load(str(path))  # what make quantize will read: refused here, not later
    print(_summary(table, choice, counts, how, path))
    if fast:
        print(f"predicted speedup: {fast.text()} the baseline's throughput (at the uniform "
              f"variants' measured speedups and their intervals' ends; make all RECIPE={name} "
              "measures it, with its interval)")
    print(f"how such predictions have held: {record}\nthe prediction: "
          + (refined or calibrated + (f" (as scanned: {raw:.4f})" if factors else "")))
    if not menu.target.here:
        print(f"for {menu.target.described}: served there, not here; on this machine bench "
              "reports it unsupported with vLLM's reason and eval scores it emulated "
              "(de-compressed weights), as the report says")
    base_name = table.baseline["name"]
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if tracking.find_run(base_name, SEARCH, key):  # the same recipe searched before
        return path
    tracking.log_run(
        base_name, SEARCH, f"search:{name}",
        params={tracking.PARAM_BASELINE: base_name, tracking.PARAM_RECIPE: name, "how": how,
                "formats": ",".join(table.formats), "sensitivity": table.cache_key,
                "target": menu.target.name, "method": settings.method},
        metrics={"predicted_weight_bytes": choice.bytes, "predicted_kl": choice.damage,
                 **{f"units_{fmt}": n for fmt, n in counts.items()}},
        tags={tracking.TAG_CACHE_KEY: key}, artifacts=[path])
    return path


def _summary(table: SensitivityTable, choice: Choice, counts: dict[str, int], how: str,
             path: Path) -> str:
    lines = [f"{paths.shown(path)}: {how}",
             "units: " + ", ".join(f"{n} {fmt}" for fmt, n in counts.items()),
             f"{'':22}{'weights':>12}{'predicted KL':>14}",
             f"{'this recipe':22}{choice.bytes / 1e6:9.1f} MB{choice.damage:14.4f}"]
    for fmt in table.formats:
        size, damage = table.uniform(fmt)
        lines.append(f"{'every unit ' + fmt:22}{size / 1e6:9.1f} MB{damage:14.4f}")
    lines.append(f"next: make all RECIPE=\"int4 int8 {path.stem}\" (quantize, serve, bench, "
                 "score; the report shows predicted against measured KL)")
    return "\n".join(lines)

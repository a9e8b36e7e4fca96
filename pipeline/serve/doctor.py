"""``qpipe doctor`` (``make doctor``): this machine, and which formats its vLLM can serve, and why.

Three kinds of evidence, each named where it is shown:

- ``probe``: the vLLM CPU kernel library this CPU makes vLLM load, opened in the serving
  environment, and whether it holds the op a format's kernel calls (e.g. ``cpu_gemm_wna16``);
- ``measured here``: what qpipe's own runs on this hardware key saw (a refusal remembered by
  bench or eval, or a variant served and measured by bench);
- ``vLLM 0.32 source``: the kernel-selection rules read from vLLM's source and docs, for what
  neither of the above covers (GPU generations, formats with no CPU kernel at all).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import Field

from pipeline.core import formats, hardware, paths
from pipeline.core.fsutil import read_json
from pipeline.core.settings import StageSettings
from pipeline.serve.server import WORKERS_DIR, serve_python

SERVES, UNSUPPORTED, PARTIAL, UNKNOWN = "serves", "unsupported", "serves (degraded)", "unknown"
SOURCE = "vLLM 0.32 source"


@dataclass(frozen=True)
class Support:
    format: str  # compressed-tensors format, or what the row is about
    recipes: str  # the shipped recipes that make it
    status: str  # serves | unsupported | serves (degraded) | unknown
    why: str
    source: str  # probe | measured here | vLLM 0.32 source


def _name(fmt: formats.Format) -> str:
    return f"{fmt.compressed[0]} ({fmt.label})" if fmt.key != "bf16" else "dense bf16"


def cpu_support(prof: hardware.Profile, probe: dict[str, Any] | None,
                source: str = "probe") -> list[Support]:
    """Each format on this CPU: from the kernel-library probe where an op decides it (or, for
    another CPU kind, from what its library is known to hold: ``source`` says which)."""
    ops = set(probe["ops"]) if probe else None
    library = probe["library"] if probe else prof.kernel_library
    out = []
    for fmt in formats.FORMATS.values():
        op, name = fmt.cpu_op, _name(fmt)
        if op is not None and ops is not None:
            has = op in ops
            out.append(Support(name, fmt.key, SERVES if has else UNSUPPORTED,
                               f"{library} {'has' if has else 'has no'} {op} ({fmt.cpu_why})"
                               + ("" if has or library == "_C" else
                                  "; AVX-512 CPUs load _C or _C_AVX512, which have it"),
                               source))
        elif fmt.cpu_needs:
            has = any(flag in prof.flags_seen for flag in fmt.cpu_needs)
            out.append(Support(name, fmt.key, SERVES if has else UNSUPPORTED,
                               fmt.cpu_why + ("" if has else ": this CPU has none"), SOURCE))
        else:
            out.append(Support(name, fmt.key, SERVES if fmt.cpu_serves else UNSUPPORTED,
                               fmt.cpu_why, SOURCE))
    amx, avx512 = "amx_tile" in prof.flags_seen, "avx512f" in prof.flags_seen
    out.append(Support("FP8 KV cache (--kv-cache-dtype fp8)", "int8-fp8kv",
                       SERVES if (amx or avx512) else UNSUPPORTED,
                       "needs AVX-512 or AMX (cpu_attn.py)"
                       + ("" if (amx or avx512) else ": this CPU has neither"), SOURCE))
    return out


def cuda_support(prof: hardware.Profile) -> list[Support]:
    """Each format on this GPU generation, from vLLM's kernel-selection rules (not measured)."""
    cc_text = prof.gpus[0].compute_capability if prof.gpus else ""
    if not cc_text:
        return [Support("all formats", "-", UNKNOWN, "the driver did not report the compute "
                        "capability", SOURCE)]
    cc = float(cc_text)

    out = []
    for fmt in formats.FORMATS.values():
        if cc >= fmt.cuda_native:
            status = SERVES
        elif fmt.cuda_degraded is not None and cc >= fmt.cuda_degraded:
            status = PARTIAL
        else:
            status = UNSUPPORTED
        why = fmt.cuda_why + ("" if status != UNSUPPORTED else
                              f" (this GPU: capability {cc_text})")
        out.append(Support(_name(fmt), fmt.key, status, why, SOURCE))
    return out


def probe_kernels(prof: hardware.Profile) -> dict[str, Any] | None:
    """The vLLM CPU kernel library and its ops, as a server here would load them."""
    if prof.target != "cpu" or not serve_python().exists():
        return None
    import os

    env = {**os.environ, **hardware.serving_environment(prof.vllm_cpu_isa)}
    try:
        out = subprocess.run([str(serve_python()),
                              str(WORKERS_DIR / "vllm_kernel_probe.py")],
                             capture_output=True, text=True, timeout=300, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if out.returncode == 0 and lines else None


def measured_here(prof: hardware.Profile) -> list[str]:
    """What qpipe's own runs saw on this hardware key: refusals and served variants."""
    names = _variant_names()
    out = []
    for path in sorted((paths.artifacts_dir() / "cache" / "unsupported").glob(
            f"*-{prof.key()}.json")):
        record = read_json(path)
        identity = path.name.removesuffix(f"-{prof.key()}.json")
        out.append(f"refused: {names.get(identity, identity)} (vLLM {record.get('vllm', '?')},"
                   f" {record.get('when', 'date unknown')}): {record.get('reason', '?')}")
    served: dict[str, str] = {}
    for summary_path in (paths.artifacts_dir() / "bench").glob("*/*/summary.json"):
        summary = read_json(summary_path)
        if summary.get("hardware", {}).get("key") != prof.key():
            continue
        for name, entry in summary.get("models", {}).items():
            if entry.get("status") == "ok":
                served[f"{summary.get('baseline', '?')}/{name}"] = entry.get("format", "?")
    out += [f"served and measured: {name} ({fmt})" for name, fmt in sorted(served.items())]
    return out


def _variant_names() -> dict[str, str]:
    names = {}
    for manifest in paths.variants_dir().glob("*/*/qpipe_manifest.json"):
        data = read_json(manifest)
        if "cache_key" in data:
            names[data["cache_key"]] = f"{manifest.parent.parent.name}/{manifest.parent.name}"
    return names


def report(prof: hardware.Profile) -> dict[str, Any]:
    probe = probe_kernels(prof)
    table = cpu_support(prof, probe) if prof.target == "cpu" else cuda_support(prof)
    return {"hardware": prof.as_dict(), "probe": probe and {
        "library": probe["library"], "ops": len(probe["ops"])},
        "formats": [asdict(s) for s in table], "measured_here": measured_here(prof)}


def render(data: dict[str, Any]) -> str:
    h = data["hardware"]
    lines = [f"machine:  {h['summary']}", f"key:      {h['key']} (caches and refusals are kept "
             "per key)"]
    if h["target"] == "cpu":
        lines.append(f"ISA seen by vLLM: {h['vllm_cpu_isa']} (VLLM_CPU_ISA=avx2 runs the AVX2 "
                     "path on any x86 CPU)")
    probe = data["probe"]
    lines.append(f"probe:    {probe['library']} loaded in the serving environment, "
                 f"{probe['ops']} ops" if probe else
                 "probe:    not run (no CPU serving environment: make setup)")
    rows = [(s["format"], s["recipes"], s["status"], s["why"], s["source"])
            for s in data["formats"]]
    widths = [max(len(r[i]) for r in [("format", "recipes", "here", "why", ""), *rows])
              for i in range(3)]
    lines += ["", "  ".join(t.ljust(w) for t, w in zip(("format", "recipes", "here"), widths,
                                                         strict=True)) + "  why [source]"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True))
              + f"  {r[3]} [{r[4]}]" for r in rows]
    if data["measured_here"]:
        lines += ["", "measured here:", *[f"  {m}" for m in data["measured_here"]]]
    return "\n".join(lines)


class DoctorSettings(StageSettings):
    json_output: bool = Field(False, description="print the report as JSON",
                              json_schema_extra={"flag": "--json"})


def run(settings: DoctorSettings) -> int:
    data = report(hardware.profile())
    print(json.dumps(data, indent=2) if settings.json_output else render(data))
    return 0

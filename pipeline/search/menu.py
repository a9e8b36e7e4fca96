"""The formats a search may give a unit: those the serving engine runs on the machine the
recipe is for (``TARGET=``: an accelerator preset, ``cpu-avx2``, ``cpu-avx512``; by default
this machine). The machine that scans is rarely the one that serves.

A searched checkpoint mixes formats layer by layer (compressed-tensors ``mixed-precision``);
vLLM picks a kernel per layer, so each format in the menu must be one it serves there.
Verified on vLLM CPU 0.32 with AVX-512: FP8 W8A8 + W8A8-int8 + W4A16 + bf16 in one model
(docs/precision-search.md); on GPUs from vLLM's kernel rules (CUTLASS int8 and FP8,
Machete/Marlin W4A16) at the preset's compute capability. On this machine the CPU rules are
decided by probing the kernel library vLLM loads here; for another CPU kind by the ops its
library is known to hold. A format not served on the target is refused with the engine's
reason (``qpipe doctor``'s evidence): FP8 weight-only (below compute capability 8.9) is not
FP8 W8A8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core import hardware
from pipeline.core import log as qlog
from pipeline.core.errors import ConfigError
from pipeline.plan.accelerators import known_accelerators
from pipeline.search.recipe import FORMATS, KEEP
from pipeline.serve import doctor

log = qlog.get("search")
HERE = "here"
# vLLM CPU's kernel libraries by ISA (vLLM 0.32's CPU wheels), and which of the rules' ops each
# holds: _C_AVX2 has no cpu_gemm_wna16 (probed on an AVX2-only host), _C has it (int4 served
# natively on an AVX-512 host)
CPU_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "cpu-avx2": ("_C_AVX2", ("onednn_scaled_mm",)),
    "cpu-avx512": ("_C", ("onednn_scaled_mm", "cpu_gemm_wna16")),
}
# served, but so slowly that a search for the least damage would trade the model's speed for a
# little accuracy unawares: left out of the default menu (FORMATS= adds it), by target kind
SLOW = {
    "cpu": {"fp8": "vLLM CPU runs FP8 W8A8 through a torch scaled-mm path, several times "
                   "slower than the baseline it replaces (the measured "
                   "figures in docs/precision-search.md); FORMATS=\"int4 int8 fp8\" adds it"},
}
# formats the shipped recipes use that a searched recipe cannot hold yet, and why
NOT_IN_MENU = {
    "mxfp4": "not offered: MXFP4 has no vLLM CPU kernel, and mixing it with other formats in "
             "one checkpoint has not been checked on GPUs (the GPU lent here cannot hold vLLM)",
}


@dataclass(frozen=True)
class Target:
    """The machine a searched recipe is for, and what vLLM serves there."""

    name: str  # here | cpu-avx2 | cpu-avx512 | an accelerator preset
    kind: str  # cpu | cuda
    described: str  # in words, as the search and the recipe say it
    here: bool  # the machine that scans (its served figures can be measured here)
    support: dict[str, tuple[bool, str]] = field(default_factory=dict)  # format -> (ok, why)
    # this machine's hardware key (here), or the part every key of the target's kind holds
    hardware: str = ""

    def measures(self, key: str) -> bool:
        """Whether figures measured on the machine of hardware ``key`` are this target's."""
        if not key or not self.hardware:
            return False
        return key == self.hardware if self.name == HERE else self.hardware in key


def target_names() -> list[str]:
    return [HERE, *CPU_TARGETS, *sorted(known_accelerators())]


def target(name: str | None = None) -> Target:
    """``TARGET=``: this machine (None or ``here``), a CPU kind or an accelerator preset."""
    prof = hardware.profile()
    key = (name or HERE).strip().lower()
    if key == HERE:
        return Target(HERE, prof.target, f"this machine ({prof.describe()})", True,
                      _support(prof, None), prof.key())
    if key in CPU_TARGETS:
        library, ops = CPU_TARGETS[key]
        probed = doctor.probe_kernels(prof) if prof.target == "cpu" else None
        if probed is not None and probed.get("library") == library:
            return Target(key, "cpu", f"{key} (vLLM CPU's {library}, as on this machine)",
                          True, _support(prof, probed), key)
        known = {"library": library, "ops": list(ops)}
        return Target(key, "cpu", f"{key} (vLLM CPU's {library}; not this machine)", False,
                      _support(prof, known, f"{doctor.SOURCE}: {library}'s ops"), key)
    presets = known_accelerators()
    preset = presets.get(key)
    if preset is None:
        raise ConfigError(f"TARGET={name}: not a machine the search knows; the targets are "
                          f"{', '.join(target_names())} (an accelerator preset in "
                          "configs/accelerators/, or a CPU kind).")
    if not preset.compute_capability:
        raise ConfigError(f"TARGET={name}: configs/accelerators/{preset.name}.yaml has no "
                          "compute_capability, which decides the kernels vLLM chooses there. "
                          "Fix: add it (e.g. compute_capability: \"9.0\" for Hopper).")
    card = hardware.Gpu(name=preset.description, memory_mib=preset.memory_bytes // 2**20,
                        compute_capability=preset.compute_capability)
    here = prof.target == "cuda" and bool(prof.gpus) and \
        prof.gpus[0].compute_capability == preset.compute_capability
    gpu = hardware.Profile(target="cuda", machine=prof.machine, cpu_model=prof.cpu_model,
                           cores=prof.cores, cpu_flags=prof.cpu_flags, vllm_cpu_isa="native",
                           vllm=prof.vllm, gpus=(card,))
    return Target(preset.name, "cuda", f"{preset.description} (compute capability "
                  f"{preset.compute_capability}, from vLLM's kernel rules)"
                  + ("" if here else "; not this machine"), here, _support(gpu, None),
                  f"-sm{preset.compute_capability.replace('.', '')}")


def _support(prof: hardware.Profile, probe: dict | None,
             source: str = "probe") -> dict[str, tuple[bool, str]]:
    """Each searchable format -> (served, the evidence), from ``qpipe doctor``'s rules."""
    if prof.target == "cpu":
        table = doctor.cpu_support(prof, probe if probe is not None else
                                   doctor.probe_kernels(prof), source)
    else:
        table = doctor.cuda_support(prof)
    by_recipe = {row.recipes: row for row in table}
    out = {}
    for fmt in FORMATS:
        row = by_recipe.get(fmt)
        out[fmt] = ((row.status == doctor.SERVES, f"{row.why} ({row.source})") if row
                    else (False, "no rule for it on this machine"))
    return out


@dataclass(frozen=True)
class Menu:
    """The formats a search may choose (bf16 last), for a target, and why others are not."""

    target: Target
    formats: list[str]
    left_out: dict[str, str]  # format -> why it is not in the menu


def resolve(requested: list[str] | None, target_name: str | None = None) -> Menu:
    """The menu: ``requested`` checked, or every format served on the target at speed."""
    where = target(target_name)
    served = where.support
    if requested is None:
        slow = SLOW.get(where.kind, {})
        menu = [fmt for fmt, (ok, _) in served.items() if ok and fmt not in slow]
        left_out = {}
        for fmt, (ok, why) in served.items():
            if not ok:
                left_out[fmt] = f"vLLM does not serve it on {where.described}: {why}"
            elif fmt in slow:
                left_out[fmt] = slow[fmt]
        for fmt, why in left_out.items():
            log.info(f"{fmt} left out of the menu: {why}")
        return Menu(where, [*menu, KEEP], left_out)
    menu = []
    for fmt in dict.fromkeys(f.strip().lower() for f in requested):
        if fmt == KEEP:
            continue
        if fmt in NOT_IN_MENU:
            raise ConfigError(f"FORMATS={fmt}: {NOT_IN_MENU[fmt]}. The search's formats are "
                              f"{', '.join([*FORMATS, KEEP])}.")
        if fmt not in FORMATS:
            raise ConfigError(f"FORMATS={fmt}: not a format the search knows; the formats are "
                              f"{', '.join([*FORMATS, KEEP])}.")
        ok, why = served[fmt]
        if not ok:
            raise ConfigError(f"FORMATS={fmt}: vLLM does not serve it on {where.described}: "
                              f"{why}. A searched recipe must be servable where it is deployed; "
                              f"leave {fmt} out, or name the machine you deploy on with TARGET= "
                              f"({', '.join(target_names())}).")
        menu.append(fmt)
    return Menu(where, [*menu, KEEP], {})

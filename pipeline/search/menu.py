"""The formats a search may give a unit: those the serving engine runs on this machine.

A searched checkpoint mixes formats layer by layer (compressed-tensors ``mixed-precision``);
vLLM picks a kernel per layer, so each format in the menu must be one it serves here. Verified
on vLLM CPU 0.32 with AVX-512: FP8 W8A8 + W8A8-int8 + W4A16 + bf16 in one model
(docs/precision-search.md); on GPUs from vLLM's kernel rules (CUTLASS int8 and FP8,
Machete/Marlin W4A16). A format not served here is refused with the engine's reason
(``qpipe doctor``'s evidence): FP8 weight-only (below compute capability 8.9) is not FP8 W8A8.
"""

from __future__ import annotations

from pipeline.core import hardware
from pipeline.core import log as qlog
from pipeline.core.errors import ConfigError
from pipeline.search.recipe import FORMATS, KEEP
from pipeline.serve import doctor

log = qlog.get("search")
# served here, but so slowly that a search for the least damage would trade the model's speed
# for a little accuracy unawares: left out of the default menu (FORMATS= adds it), by target
SLOW = {
    "cpu": {"fp8": "vLLM CPU runs FP8 W8A8 through a torch scaled-mm path, the slowest format "
                   "there (uniform fp8 served at 0.09x the baseline's throughput and a searched "
                   "mix with fp8 units at 0.28x, on this project's 2-core CPU); FORMATS=\"int4 "
                   "int8 fp8\" adds it"},
}
# formats the shipped recipes use that a searched recipe cannot hold yet, and why
NOT_IN_MENU = {
    "mxfp4": "not offered: MXFP4 has no vLLM CPU kernel, and mixing it with other formats in "
             "one checkpoint has not been checked on GPUs (the GPU lent here cannot hold vLLM)",
}


def support() -> dict[str, tuple[bool, str]]:
    """Each searchable format -> (served here, the evidence), from ``qpipe doctor``'s rules."""
    prof = hardware.profile()
    table = (doctor.cpu_support(prof, doctor.probe_kernels(prof)) if prof.target == "cpu"
             else doctor.cuda_support(prof))
    by_recipe = {row.recipes: row for row in table}
    out = {}
    for fmt in FORMATS:
        row = by_recipe.get(fmt)
        out[fmt] = ((row.status == doctor.SERVES, f"{row.why} ({row.source})") if row
                    else (False, "no rule for it on this machine"))
    return out


def resolve(requested: list[str] | None) -> list[str]:
    """The menu: ``requested`` checked, or every format served here at speed; bf16 last."""
    served = support()
    if requested is None:
        slow = SLOW.get(hardware.profile().target, {})
        menu = [fmt for fmt, (ok, _) in served.items() if ok and fmt not in slow]
        for fmt, (ok, why) in served.items():
            if not ok:
                log.info(f"{fmt} left out of the menu: vLLM does not serve it here ({why})")
            elif fmt in slow:
                log.info(f"{fmt} left out of the default menu: {slow[fmt]}")
        return [*menu, KEEP]
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
            raise ConfigError(f"FORMATS={fmt}: vLLM does not serve it on this machine: {why}. "
                              "A searched recipe must be servable where it is measured; leave "
                              f"{fmt} out (`make doctor` lists what this machine serves).")
        menu.append(fmt)
    return [*menu, KEEP]

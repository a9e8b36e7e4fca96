"""One table of the weight formats qpipe knows, and how a checkpoint is identified as one.

A row says what a format stores (bits, scales, groups), what its checkpoint's
compressed-tensors ``quantization_config`` looks like, which vLLM kernels serve it where, and
where it is deployed. A checkpoint is identified once, from its ``config.json`` (what vLLM
reads), and the :class:`Identified` result is recorded in its manifest; every later stage reads
attributes of the row, never a display label. A new format is a recipe file plus, where none
of these rows describes it, one row here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.core.errors import ConfigError

MIXED = "mixed"  # a searched checkpoint: a format per layer
DENSE = "dense"  # no quantization_config: the compressed-tensors name for it


@dataclass(frozen=True)
class Format:
    """One weight format: its numerics, storage, serving rules and deployment."""

    key: str  # the name the planner, search and report use (bf16, int4, fp8, ...)
    label: str  # in words: "INT4 W4A16"
    compressed: tuple[str, ...]  # compressed-tensors ``format`` strings a checkpoint of it has
    weight_type: str  # int | float
    weight_bits: int
    activation_bits: int = 16  # 16: activations unquantized (weight-only)
    strategies: tuple[str, ...] = ("channel",)  # compressed-tensors weight strategies
    group_size: int | None = None  # fixed by the format (mxfp4 32, nvfp4 16); None: the
    # recipe's (int4) or none (per channel / block)
    scale_bytes: int = 0  # per group, row or block
    block: tuple[int, int] | None = None  # (rows, cols) sharing one scale (FP8 block-wise)
    tensor_scale_bytes: int = 0  # per matrix (nvfp4's global fp32 scale)
    weights: str = ""  # the planner's weight precision (default: the key)
    # vLLM CPU: the kernel-library op its kernel calls (the probe decides), else whether it
    # serves at all and why; CPU flags it needs (any of them)
    cpu_op: str | None = None
    cpu_serves: bool = True
    cpu_why: str = ""
    cpu_needs: tuple[str, ...] = ()
    # vLLM CUDA: the compute capability it needs natively, the one from which it runs degraded
    # (weights in the format, activations bf16), and the kernels
    cuda_native: float = 8.0
    cuda_degraded: float | None = None
    cuda_why: str = ""
    served_on: str = "a GPU build of vLLM"  # where a machine that refuses it sends you
    searchable: bool = False  # the precision search may give a layer this format
    search_args: Mapping[str, Any] | None = None  # its config_group arguments in a search

    @property
    def precision(self) -> str:
        """The planner's weight precision (bytes per weight): nvfp4 with or without A4."""
        return self.weights or self.key

    @property
    def weight_only(self) -> bool:
        return self.activation_bits >= 16

    def describe(self, group_size: int | None = None, symmetric: bool = True) -> str:
        """The row's label with what the checkpoint chose: "INT4 W4A16 (group 64, asymmetric)"."""
        parts = [f"group {group_size}"] if group_size and self.group_size is None else []
        if not symmetric:
            parts.append("asymmetric")
        return self.label + (f" ({', '.join(parts)})" if parts else "")


_W4A16_SEARCH = {"weights": {"num_bits": 4, "type": "int", "symmetric": True,
                             "strategy": "group", "group_size": 64}}
_W8A8 = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
_SEARCH_INT8 = {"weights": {"num_bits": 8, "type": "int", "symmetric": True,
                            "strategy": "channel"},
                "input_activations": {**_W8A8, "type": "int"}}
_SEARCH_FP8 = {"weights": {"num_bits": 8, "type": "float", "symmetric": True,
                           "strategy": "channel"},
               "input_activations": {**_W8A8, "type": "float"}}

FORMATS: dict[str, Format] = {f.key: f for f in (
    Format("bf16", "bf16 (dense)", (DENSE,), "float", 16, cpu_why="torch / oneDNN GEMMs",
           cuda_why="bf16 needs capability >= 8.0", served_on="any vLLM build"),
    Format("int4", "INT4 W4A16", ("pack-quantized",), "int", 4,
           strategies=("group", "channel"), scale_bytes=2, cpu_op="cpu_gemm_wna16",
           cpu_why="CPUWNA16 kernel",
           cuda_why="Machete on 9.0 only for layers with input features % 64 and output "
                    "features % 128 on each rank (group -1/64/128), Marlin for the rest and "
                    "from 8.0 (group -1/32/64/128)",
           served_on="NVIDIA GPUs from Ampere (Marlin, Machete on Hopper); x86 CPUs with "
                     "AVX-512 (vLLM's _C / _C_AVX512 kernel libraries)",
           searchable=True, search_args=_W4A16_SEARCH),
    Format("int2", "INT2 W2A16", ("pack-quantized",), "int", 2,
           strategies=("group", "channel"), scale_bytes=2, cpu_serves=False,
           cpu_why="vLLM's WNA16 kernels take 4- and 8-bit weights only",
           cuda_native=99.0, cuda_why="vLLM's WNA16 kernels take 4- and 8-bit weights only",
           served_on="no vLLM build (scored emulated: de-compressed in transformers)"),
    Format("w8a16", "INT8 W8A16", ("pack-quantized",), "int", 8,
           strategies=("group", "channel"), scale_bytes=2, cpu_serves=False,
           cpu_why="vLLM CPU's WNA16 kernel (CPUWNA16) takes 4-bit weights only (uint4, "
                   "uint4b8): \"Failed to find a kernel that can implement the WNA16 linear "
                   "layer\"",
           cuda_why="Marlin / Machete WNA16 from 8.0",
           served_on="NVIDIA GPUs from Ampere (Marlin, Machete on Hopper)"),
    Format("int8", "INT8 W8A8", ("int-quantized", "naive-quantized"), "int", 8, 8,
           scale_bytes=2, cpu_op="onednn_scaled_mm", cpu_why="oneDNN scaled mm",
           cuda_native=7.5, cuda_why="CUTLASS scaled mm",
           served_on="NVIDIA GPUs from Turing (CUTLASS); x86 CPUs (oneDNN)",
           searchable=True, search_args=_SEARCH_INT8),
    Format("fp8", "FP8 W8A8", ("float-quantized", "naive-quantized"), "float", 8, 8,
           strategies=("channel", "tensor"), scale_bytes=2,
           cpu_why="a torch scaled-mm path, the slowest of the served formats on CPUs",
           cuda_native=8.9, cuda_degraded=8.0,
           cuda_why="native FP8 W8A8 from 8.9; below it, from 8.0, served as W8A16Fp8 "
                    "through Marlin (weights FP8, activations bf16)",
           served_on="GPUs with FP8 support (Ada, Hopper, Blackwell)",
           searchable=True, search_args=_SEARCH_FP8),
    Format("fp8-block", "FP8 W8A8 block-wise (128x128 weight blocks)", ("float-quantized",),
           "float", 8, 8, strategies=("block",), scale_bytes=4, block=(128, 128),
           weights="fp8-block", cpu_needs=("amx_tile",),
           cpu_why="vLLM CPU's block-FP8 kernels \"require AMX tile support (Sapphire Rapids "
                   "or newer)\"; W8A8 only with AMX-FP8, else W8A16 (activations bf16)",
           cuda_native=8.9, cuda_degraded=8.0,
           cuda_why="CUTLASS / DeepGEMM block FP8 from 8.9 (Hopper), Marlin W8A16 from 8.0",
           served_on="NVIDIA Hopper and Blackwell GPUs (block FP8 as DeepSeek ships it)"),
    Format("mxfp4", "MXFP4 W4A16", ("mxfp4-pack-quantized",), "float", 4,
           strategies=("group",), group_size=32, scale_bytes=1, cpu_serves=False,
           cpu_why="no CPU kernel: \"Failed to find a kernel that can implement the MXFP4 "
                   "linear layer\" (vLLM's emulation kernel is CUDA-only)",
           cuda_why="native on Blackwell (10.x), Marlin MXFP4 from 8.0",
           served_on="NVIDIA Blackwell GPUs (native MXFP4); Hopper through vLLM's "
                     "Marlin/emulation kernels"),
    Format("nvfp4", "NVFP4 W4A4", ("nvfp4-pack-quantized",), "float", 4, 4,
           strategies=("tensor_group",), group_size=16, scale_bytes=1, tensor_scale_bytes=4,
           cpu_serves=False, cpu_why="no CPU kernel (CUTLASS / Marlin FP4 are CUDA-only)",
           cuda_native=10.0, cuda_degraded=8.0,
           cuda_why="native W4A4 on Blackwell (10.x); from 8.0 the weights through Marlin FP4 "
                    "with bf16 activations",
           served_on="NVIDIA Blackwell GPUs (native NVFP4); Hopper/Ada through Marlin"),
    Format("nvfp4a16", "NVFP4 W4A16", ("nvfp4-pack-quantized",), "float", 4,
           strategies=("tensor_group",), group_size=16, scale_bytes=1, tensor_scale_bytes=4,
           weights="nvfp4", cpu_serves=False,
           cpu_why="no CPU kernel (Marlin FP4 is CUDA-only)",
           cuda_why="Marlin FP4 from 8.0, native on Blackwell (10.x)",
           served_on="NVIDIA GPUs from Ampere (Marlin FP4); Blackwell natively"),
)}

WEIGHT_PRECISIONS: tuple[str, ...] = tuple(dict.fromkeys(f.precision for f in FORMATS.values()))
SEARCHABLE: dict[str, Format] = {k: f for k, f in FORMATS.items() if f.searchable}


def scanned_as(key: str, group_size: int | None, symmetric: bool) -> str | None:
    """The search format a uniform checkpoint is (row ``key``, the group size and zero points
    it chose) where it is quantized as the search scans that format, else None: AWQ's
    asymmetric group-128 INT4 is not the scan's symmetric group-64 INT4."""
    fmt = FORMATS.get(key)
    if fmt is None or not fmt.searchable or fmt.search_args is None:
        return None
    weights = fmt.search_args["weights"]
    scanned_group = weights.get("group_size") if weights.get("strategy") == "group" else None
    if group_size != scanned_group or symmetric != weights.get("symmetric", True):
        return None
    return fmt.key


def get(key: str) -> Format:
    """The row named ``key``; an unknown name is refused with the known ones."""
    if key not in FORMATS:
        raise ConfigError(f"format {key!r} is not in qpipe's format table "
                          f"(pipeline/core/formats.py); the formats are {', '.join(FORMATS)}")
    return FORMATS[key]


def by_compressed(name: str) -> list[Format]:
    """The rows whose checkpoints carry the compressed-tensors format ``name``."""
    return [f for f in FORMATS.values() if name in f.compressed]


class Identified(BaseModel):
    """A checkpoint's weight format as its config.json says it: the table row (or ``mixed``),
    and what the recipe chose within it."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    key: str  # a FORMATS key, or MIXED
    group_size: int | None = None  # inputs per scale (None: per channel or block)
    symmetric: bool = True  # False: a zero point per group (AWQ)
    layers: dict[str, int] = {}  # a mixed checkpoint: format -> the layers' count

    @property
    def format(self) -> Format | None:
        return FORMATS.get(self.key)

    @property
    def precision(self) -> str:
        return self.format.precision if self.format else MIXED

    def describe(self) -> str:
        if self.format is None:
            return "mixed: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.layers.items()))
        return self.format.describe(self.group_size, self.symmetric)


# where a config.json keeps its quantization section: the current key, then the older one
QUANT_SECTIONS = ("quantization_config", "compression_config")


def quant_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A config.json's quantization section (:data:`QUANT_SECTIONS`), empty for a dense
    model."""
    return next((config[k] for k in QUANT_SECTIONS if config.get(k)), {})


def _group(group: Mapping[str, Any], fmt: str, where: str) -> tuple[Format, int | None, bool]:
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    if not weights:
        raise ConfigError(f"{where}: a config group with no `weights`; qpipe plans weight "
                          "formats only. Fix: quantize the weights, or leave the layers out of "
                          "the recipe")
    wtype, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy") or "channel"
    abits = acts.get("num_bits") or 16
    found = [f for f in FORMATS.values()
             if fmt in f.compressed and f.weight_type == wtype and f.weight_bits == bits
             and f.activation_bits == abits and strategy in f.strategies]
    if not found:
        raise ConfigError(
            f"{where}: weights {wtype} {bits}-bit {strategy} with {abits}-bit activations in "
            f"format {fmt!r} match no row of qpipe's format table (pipeline/core/formats.py: "
            f"{', '.join(FORMATS)}). Fix: add a row for it there.")
    group_size = weights.get("group_size") if strategy in ("group", "tensor_group") else None
    return found[0], group_size, weights.get("symmetric", True) is not False


def identify(config: Mapping[str, Any], where: str = "config.json") -> Identified:
    """The weight format of a checkpoint from its ``config.json`` (``where`` names it in an
    error): a checkpoint with no quantization config is bf16; one whose groups differ is
    mixed (a searched recipe)."""
    qc = quant_config(config)
    if not qc:
        return Identified(key="bf16")
    fmt = str(qc.get("format") or qc.get("quant_method") or DENSE)
    groups = qc.get("config_groups") or {}
    if not groups:
        found = by_compressed(fmt)
        if not found:
            raise ConfigError(f"{where}: quantization format {fmt!r} has no config_groups and "
                              "is not in qpipe's format table (pipeline/core/formats.py)")
        return Identified(key=found[0].key)
    seen: dict[tuple[str, int | None, bool], int] = {}
    for name, group in groups.items():
        # a mixed checkpoint names each group's own format
        row, size, sym = _group(group, str(group.get("format") or fmt),
                                f"{where}: quantization_config.config_groups.{name}")
        layers = len(group.get("targets") or ())
        seen[(row.key, size, sym)] = seen.get((row.key, size, sym), 0) + layers
    if len({key for key, _, _ in seen}) == 1 and len(seen) == 1:
        (key, size, sym), = seen
        return Identified(key=key, group_size=size, symmetric=sym)
    counts: dict[str, int] = {}
    for (key, _, _), n in seen.items():
        counts[key] = counts.get(key, 0) + n
    sizes = {size for (_, size, _) in seen if size}
    return Identified(key=MIXED, group_size=min(sizes) if sizes else None,
                      symmetric=all(sym for (_, _, sym) in seen), layers=counts)

"""What this machine is, as far as serving kernels care: CPU ISA, GPUs, the vLLM build.

vLLM's CPU build ships three kernel libraries and loads one at start-up by the CPU's features
(``vllm/platforms/cpu.py``, ``import_kernels``): ``_C`` (AVX-512 with bf16), ``_C_AVX512`` and
``_C_AVX2``. Which formats a machine serves follows from that choice (``_C_AVX2`` has no
``cpu_gemm_wna16``, so W4A16 cannot run), and on GPUs from the compute capability. Every bench
and eval run records this profile, caches and refusal memories are keyed by it, and
``qpipe doctor`` prints it.

``QPIPE_VLLM_CPU_ISA=avx2`` (Makefile ``VLLM_CPU_ISA=avx2``) makes the vLLM servers qpipe starts
see a CPU without AVX-512 and AMX, so they load ``_C_AVX2`` as an AVX2-only machine would: the
AVX2 path can be run and tested on any x86 machine (``avx512`` keeps AVX-512 without bf16:
``_C_AVX512``).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.core.errors import ConfigError

ISA_ENV = "QPIPE_VLLM_CPU_ISA"
ISAS = ("native", "avx512", "avx2")
# The flags that decide which kernels vLLM CPU and torch use (as /proc/cpuinfo spells them).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl",
                "amx_tile", "amx_bf16", "amx_int8")
# A sitecustomize.py that hides AVX-512 and AMX from torch.cpu in the serving processes.
SHIM_DIR = Path(__file__).with_name("isa_shim")
LIBRARY_ISA = {"_C": "AVX-512 with bf16", "_C_AVX512": "AVX-512 without bf16",
               "_C_AVX2": "AVX2"}


@dataclass(frozen=True)
class Gpu:
    name: str  # the parent card's, also for a MIG slice (as nvidia-smi names it)
    memory_mib: int | None  # None where nvidia-smi says [N/A] (MIG instances)
    compute_capability: str  # "9.0"; "" if the driver does not report it
    mig_profile: str = ""  # "1g.10gb" where the device the servers see is a MIG slice

    @property
    def visible_memory_mib(self) -> int | None:
        """The memory a server on this device has: the card's, or its MIG slice's (the
        profile's nominal GB)."""
        if self.mig_profile:
            found = re.search(r"\.(\d+)gb$", self.mig_profile)
            return int(found.group(1)) * 1000 * 1000 * 1000 // 2**20 if found else None
        return self.memory_mib


@dataclass(frozen=True)
class Profile:
    """The hardware facts behind a figure: recorded with every bench and eval run."""

    target: str  # cpu | cuda
    machine: str  # x86_64, aarch64
    cpu_model: str
    cores: int
    cpu_flags: tuple[str, ...]  # the KERNEL_FLAGS this CPU has (before any forced ISA)
    vllm_cpu_isa: str  # native, or the ISA the serving processes are made to see
    vllm: str  # the serving environment's vLLM version
    gpus: tuple[Gpu, ...] = ()

    @property
    def flags_seen(self) -> tuple[str, ...]:
        """The flags vLLM CPU sees: all of them, or without AVX-512 / AMX (or bf16) if forced."""
        if self.vllm_cpu_isa == "avx2":
            return tuple(f for f in self.cpu_flags if not f.startswith(("avx512", "amx")))
        if self.vllm_cpu_isa == "avx512":
            return tuple(f for f in self.cpu_flags if f not in ("avx512_bf16",)
                         and not f.startswith("amx"))
        return self.cpu_flags

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 arithmetic runs in hardware (CPU: AVX-512 bf16 or AMX; GPUs: taken as
        yes). Without it vLLM CPU emulates bf16 and float32 may serve faster."""
        if self.target != "cpu":
            return True
        return any(f in self.flags_seen for f in ("avx512_bf16", "amx_bf16"))

    @property
    def kernel_library(self) -> str:
        """The vLLM CPU kernel library this CPU makes vLLM load (``import_kernels``)."""
        if self.machine not in ("x86_64", "AMD64"):
            return "_C"
        seen = self.flags_seen
        if "avx512f" in seen:
            return "_C" if "avx512_bf16" in seen else "_C_AVX512"
        return "_C_AVX2"

    @property
    def isa(self) -> str:
        """avx512bf16 | avx512 | avx2 (+amx): the class of CPU that decides vLLM's kernels."""
        seen = self.flags_seen
        isa = {"_C": "avx512bf16", "_C_AVX512": "avx512", "_C_AVX2": "avx2"}[
            self.kernel_library] if self.machine in ("x86_64", "AMD64") else self.machine
        return isa + ("+amx" if "amx_tile" in seen else "")

    def key(self) -> str:
        """Short, file-name safe: caches and refusal memories are kept per key."""
        if self.target == "cuda" and self.gpus:
            gpu = self.gpus[0]
            name = re.sub(r"[^A-Za-z0-9]+", "-", gpu.name).strip("-").lower()
            cc = gpu.compute_capability.replace(".", "")
            # the memory the servers see: an H100 NVL (94 GB) or a MIG slice is not an H100 80GB
            memory = gpu.visible_memory_mib
            size = f"-{round(memory / 1024)}g" if memory else ""
            mig = "-mig" + re.sub(r"[^a-z0-9]+", "", gpu.mig_profile) if gpu.mig_profile else ""
            return f"cuda-{name}-sm{cc or 'unknown'}{size}{mig}"
        return f"cpu-{self.isa}"

    def describe(self) -> str:
        """One line for tables, run params and the report."""
        if self.target == "cuda" and self.gpus:
            gpu = self.gpus[0]
            visible = gpu.visible_memory_mib
            memory = f"{visible / 1024:.0f} GiB" if visible else "memory n/a"
            if gpu.mig_profile:
                memory = f"MIG slice {gpu.mig_profile}, {memory}"
            cc = f", compute capability {gpu.compute_capability}" \
                if gpu.compute_capability else ""
            count = f"{len(self.gpus)}x " if len(self.gpus) > 1 else ""
            return f"{count}{gpu.name} ({memory}{cc}); vLLM {self.vllm}"
        flags = ", ".join(self.flags_seen) or "no AVX2"
        forced = f" (forced {self.vllm_cpu_isa}: QPIPE_VLLM_CPU_ISA)" \
            if self.vllm_cpu_isa != "native" else ""
        return (f"{self.machine} {self.cpu_model}, {self.cores} cores, {flags}{forced}; "
                f"vLLM {self.vllm} loads {self.kernel_library} "
                f"({LIBRARY_ISA.get(self.kernel_library, self.machine)})")

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(key=self.key(), kernel_library=self.kernel_library, summary=self.describe())
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], target: str) -> Profile:
        """A profile read back from :meth:`as_dict` as a run recorded it (``target`` where the
        record lacks one; missing facts left empty)."""
        gpus = tuple(Gpu(g.get("name", "?"), g.get("memory_mib"), g.get("compute_capability", ""),
                         g.get("mig_profile", "")) for g in data.get("gpus") or ())
        return cls(target=data.get("target", target), machine=data.get("machine", ""),
                   cpu_model=data.get("cpu_model", "?"), cores=int(data.get("cores") or 0),
                   cpu_flags=tuple(data.get("cpu_flags") or ()),
                   vllm_cpu_isa=data.get("vllm_cpu_isa", "native"), vllm=data.get("vllm", ""),
                   gpus=gpus)


def serving_devices(prof: Profile, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    visible: str | None = None) -> dict[str, Any]:
    """What one server of a bench run uses, as its price is computed from: on a GPU host the
    card (its name and memory), TP x PP of them, and whether it is a MIG slice (``visible``:
    the CUDA_VISIBLE_DEVICES the servers saw, this process's by default); on a CPU host the
    host itself. Not every GPU the host has: an 8-GPU node's TP = 1 server uses one."""
    if prof.target == "cuda" and prof.gpus:
        gpu = prof.gpus[0]
        seen = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible is None else visible
        mig = bool(gpu.mig_profile) or "MIG-" in seen or gpu.memory_mib is None
        return {"unit": "gpu", "kind": gpu.name, "memory_mib": gpu.visible_memory_mib,
                "mig_profile": gpu.mig_profile,
                "count": tensor_parallel * pipeline_parallel, "mig": mig,
                "host_gpus": len(prof.gpus), "key": prof.key()}
    return {"unit": "host", "kind": f"{prof.cpu_model} ({prof.cores} cores)", "count": 1,
            "mig": False, "key": prof.key()}


def forced_isa() -> str:
    """The ISA the serving processes are made to see (``QPIPE_VLLM_CPU_ISA``), or native."""
    value = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if value not in ISAS:
        raise ConfigError(f"{ISA_ENV}={value!r} is not one of {', '.join(ISAS)} (VLLM_CPU_ISA= "
                          "in make): avx2 makes vLLM CPU load its AVX2 kernels on any x86 CPU.")
    return value


def worker_cpus(allowed: set[int], core_of: dict[int, tuple[int, int]],
                node_of: dict[int, int]) -> tuple[int, ...] | None:
    """The CPUs vLLM CPU's automatic binding gives its one worker when no CPU is reserved
    (``vllm/utils/ompmultiprocessing.py``: one logical CPU per physical core, the highest id
    of each), or None where the allowed CPUs span several NUMA nodes or the topology of one
    is unknown (vLLM then binds to one node and its memory: leave that to vLLM)."""
    if not allowed or any(c not in core_of or c not in node_of for c in allowed):
        return None
    if len({node_of[c] for c in allowed}) != 1:
        return None
    per_core: dict[tuple[int, int], int] = {}
    for cpu in sorted(allowed):
        per_core[core_of[cpu]] = cpu
    return tuple(sorted(per_core.values()))


@functools.cache
def serving_cpus(system: Path = Path("/sys/devices/system")) -> tuple[int, ...] | None:
    """:func:`worker_cpus` for this process's allowed CPUs, from sysfs."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    core_of, node_of = {}, {}
    for cpu in allowed:
        topology = system / "cpu" / f"cpu{cpu}" / "topology"
        try:
            core_of[cpu] = (int((topology / "physical_package_id").read_text()),
                            int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            return None
    for node in system.glob("node/node[0-9]*"):
        try:
            text = (node / "cpulist").read_text().strip()
        except OSError:
            continue
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            for cpu in range(int(low), int(high or low) + 1):
                node_of[cpu] = int(node.name.removeprefix("node"))
    if not node_of:  # no NUMA information (a kernel without it): one node
        node_of = dict.fromkeys(allowed, 0)
    return worker_cpus(set(allowed), core_of, node_of)


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """(model name, the KERNEL_FLAGS present) from /proc/cpuinfo."""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags_line = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    flags = set(flags_line.group(1).split()) if flags_line else set()
    return (model.group(1).strip() if model else platform.processor() or "unknown CPU",
            tuple(f for f in KERNEL_FLAGS if f in flags))


def parse_nvidia_smi(csv: str) -> tuple[Gpu, ...]:
    """``nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader,nounits``.

    MIG instances and some containers print ``[N/A]`` for memory: kept as None, not a crash.
    """
    gpus = []
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not parts or not parts[0]:
            continue
        memory = parts[1] if len(parts) > 1 else ""
        cc = parts[2] if len(parts) > 2 else ""
        gpus.append(Gpu(parts[0], int(float(memory)) if re.fullmatch(r"[\d.]+", memory)
                        else None, cc if re.fullmatch(r"\d+\.\d+", cc) else ""))
    return tuple(gpus)


_GPU_LINE = re.compile(r"^GPU\s+(\d+):")
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+\d+:\s*\(UUID:\s*(MIG-[^)\s]+)\)")


def mig_profile(listing: str, visible: str) -> str:
    """The MIG profile ("1g.10gb") of the device the servers see, from ``nvidia-smi -L``:
    the slice ``visible`` (CUDA_VISIBLE_DEVICES) names by UUID, else the first slice of the
    first card it names by index (card 0 when it names none): where a card is in MIG mode,
    CUDA sees its slices, not the card. "" where that device is a whole card."""
    first = visible.split(",")[0].strip()
    card = int(first) if first.isdigit() else 0
    slices, current = [], -1
    for line in listing.splitlines():
        if found := _GPU_LINE.match(line):
            current = int(found.group(1))
        elif found := _MIG_LINE.match(line):
            slices.append((current, found.group(1), found.group(2)))
    named = [profile for _, profile, uuid in slices if uuid in visible]
    on_card = [profile for index, profile, _ in slices if index == card]
    return (named or ([] if first.startswith("MIG-") else on_card) or [""])[0]


def _nvidia_smi(*args: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _gpus() -> tuple[Gpu, ...]:
    for fields in ("name,memory.total,compute_cap", "name,memory.total"):
        out = _nvidia_smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits")
        if out is not None:
            gpus = parse_nvidia_smi(out)
            profile = mig_profile(_nvidia_smi("-L") or "",
                                  os.environ.get("CUDA_VISIBLE_DEVICES", ""))
            if gpus and profile:
                gpus = (replace(gpus[0], mig_profile=profile), *gpus[1:])
            return gpus
    return ()


@functools.lru_cache(maxsize=8)
def _profile(target: str, isa: str, vllm: str) -> Profile:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    model, flags = parse_cpuinfo(text)
    return Profile(target=target, machine=platform.machine(), cpu_model=model,
                   cores=os.cpu_count() or 1, cpu_flags=flags, vllm_cpu_isa=isa, vllm=vllm,
                   gpus=_gpus() if target == "cuda" else ())


def profile() -> Profile:
    """This machine as the serving engine sees it (cached per target, forced ISA and vLLM)."""
    from pipeline.core.provenance import vllm_version

    return _profile(serve_target(), forced_isa(), vllm_version())


def torch_device() -> str:
    """Where torch runs work in this process: ``cuda`` when it sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_device_name() -> str:
    """The GPU's name, or ``cpu``: recorded with what was computed on it."""
    import torch

    return torch.cuda.get_device_name() if torch_device() == "cuda" else "cpu"


def serve_target() -> str:
    """``cuda`` where a GPU is visible, else ``cpu`` (``QPIPE_SERVE_TARGET`` overrides)."""
    target = os.environ.get("QPIPE_SERVE_TARGET", os.environ.get("SERVE_TARGET", "auto"))
    return target if target != "auto" else _detected_target()


@functools.lru_cache(maxsize=1)
def _detected_target() -> str:
    try:
        subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, timeout=20)
        return "cuda"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def serving_environment(isa: str) -> dict[str, str]:
    """Variables that make vLLM CPU (and torch in its processes) see only ``isa``."""
    if isa == "native":
        return {}
    env = {ISA_ENV: isa, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p)}
    if isa == "avx2":
        env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    return env


# What a missing kernel op means, for the sentence a user reads.
OP_FORMATS = {"cpu_gemm_wna16": "W4A16 (weight-only INT4) linear layers",
              "onednn_scaled_mm": "INT8 W8A8 linear layers"}
_MISSING_OP = re.compile(r"has no attribute '(\w+)'")


def explain(reason: str, prof: Profile) -> str:
    """The hardware fact behind an engine's refusal, in one clause."""
    missing = _MISSING_OP.search(reason)
    if prof.target == "cpu" and missing and "_OpNamespace" in reason:
        op = missing.group(1)
        what = OP_FORMATS.get(op, "this format")
        return (f"this CPU makes vLLM CPU load {prof.kernel_library} "
                f"({LIBRARY_ISA.get(prof.kernel_library, prof.machine)}: "
                f"{', '.join(prof.flags_seen) or 'no AVX2'}), which has no {op} kernel for "
                f"{what}; vLLM's _C and _C_AVX512 libraries (AVX-512 CPUs) have it")
    return f"on {prof.describe()}"

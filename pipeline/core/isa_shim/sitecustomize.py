"""Loaded by every Python process of a vLLM server that qpipe starts with QPIPE_VLLM_CPU_ISA.

It hides CPU features from ``torch.cpu.get_capabilities``, which vLLM CPU asks (through
``torch.cpu._is_avx512_supported`` and its siblings) to choose its kernel library and kernels:
``avx2`` hides AVX-512 and AMX (vLLM loads ``_C_AVX2``, as on an AVX2-only machine), ``avx512``
hides bf16 and AMX (``_C_AVX512``). Not part of qpipe's package: it runs in the serving
environment, which has only vLLM. Any sitecustomize it shadows is still run.
"""

import importlib.util
import os
import sys


def _hide(isa: str) -> None:
    import torch.cpu

    def hidden(name: str) -> bool:
        if isa == "avx2":
            return name.startswith(("avx512", "amx", "avx10"))
        return name in ("avx512_bf16", "avx512_fp16") or name.startswith(("amx", "avx10"))

    real = torch.cpu.get_capabilities

    def get_capabilities() -> dict:
        return {k: (False if hidden(k) else v) for k, v in real().items()}

    torch.cpu.get_capabilities = get_capabilities


def _chain() -> None:
    """Run the sitecustomize this one shadows, if the environment has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_qpipe_chained_sitecustomize",
                                                          candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_isa = os.environ.get("QPIPE_VLLM_CPU_ISA", "native")
if _isa in ("avx2", "avx512"):
    _hide(_isa)
_chain()

"""Why an engine failed, and whether that means "this hardware cannot serve the format".

Classified by the engine's fatal error lines only (a warning that something "is not supported"
is not why it died), a resource failure (out of memory, disk full) first. A refusal is
remembered per checkpoint, hardware key and vLLM version, the moment it happens.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from pipeline.core import hardware, paths
from pipeline.core.errors import QpipeError
from pipeline.core.fsutil import read_json, write_json_atomic
from pipeline.core.provenance import vllm_version

# vLLM's own refusal sites: the error lines by which it says it cannot run a format on this
# hardware (vLLM 0.32). Nothing broader: compile and CUDA-graph errors on GPUs ("operation not
# supported when stream is capturing", "... is not supported" from torch.compile) are failures,
# and a failure is never remembered as a fact of the hardware.
UNSUPPORTED_PATTERNS = (
    # kernel selection (model_executor/kernels/linear): no kernel for this scheme here
    r"Failed to find a kernel that can implement",
    # a vLLM CPU kernel library (_C_AVX2) without the format's op (cpu_gemm_wna16)
    r"'_OpNamespace' '_C\w*' object has no attribute",
    # compressed-tensors / quark: no scheme for this layer's format on this device
    r"No (?:compressed-tensors|quark) compatible scheme was found",
    # the quantization method's capability checks (config/vllm.py, compressed_tensors.py)
    r"is not supported for the current GPU\. M(?:in|inimum) capability",
    r"Quantization scheme is not supported for the current GPU",
    # the platform's supported_quantization (platforms/interface.py)
    r"quantization is currently not supported in \w+",
    # block-wise FP8 on a model whose layer widths are not whole blocks (fp8_utils.py,
    # validate_fp8_block_shape: SmolLM2's 576 outputs against 128-wide blocks): vLLM refuses
    # the checkpoint on every device, so it is not served anywhere and is scored emulated
    r"is not divisible by weight quantization block_[nk]",
    # the CPU attention backend (v1/attention/backends/cpu_attn.py)
    r"FP8 KV cache on CPU requires x86 with AVX-512 or AMX",
    # oneDNN (under torch's CPU ops) has no implementation of the op for these dtypes on this
    # CPU's ISA: FP8 W8A8's torch._scaled_mm on a Xeon with oneDNN held to AVX2 (vLLM itself
    # falls back from this error where it has another path: "Failed to create oneDNN linear")
    r"could not create a primitive descriptor for the \w+ primitive",
)
# Fatal errors about resources, never a format: an out-of-memory crash is not "unsupported",
# whatever the log said before it.
RESOURCE_PATTERNS = (r"out of memory", r"OutOfMemory", r"Cannot allocate memory",
                     r"No space left")
_ERROR_LINE = re.compile(r"\b\w*(?:Error|Exception)\b:|\bERROR\b")
# a line vLLM logged below ERROR: never why it died, whatever exception it quotes ("WARNING
# ... Failed to create oneDNN linear, fallback to torch linear. Exception: ...")
_NOT_FATAL = re.compile(r"^(?:\(.*?\)\s*)?(?:WARNING|INFO|DEBUG)\b")


class ServeError(QpipeError):
    """The engine failed to start, died mid-run, or never became healthy."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message  # the engine's own words, for tables and MLflow


class UnsupportedFormat(ServeError):
    """The engine cannot serve this checkpoint's format on this hardware."""


# How a too-slow refusal's reason begins (the report shows such a format as "too slow here").
TOO_SLOW = "too slow to measure here"


class TooSlow(UnsupportedFormat):
    """The engine serves the format here, but through a path so slow that measuring it would
    take hours: a hardware limit like a missing kernel, reported and remembered as one."""


def is_too_slow(reason: str) -> bool:
    """Whether a refusal's reason is a :class:`TooSlow` one."""
    return reason.startswith(TOO_SLOW)


def failure_reason(log_text: str) -> tuple[str, bool]:
    """The most telling error line of a failed engine, and whether it means 'unsupported'."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    # an error line, not a traceback's frame or source line (vLLM's workers log those at
    # ERROR level too: "ERROR ... [multiproc_executor.py:1063]     raise NotImplementedError(")
    fatal = [ln for ln in lines if _ERROR_LINE.search(ln) and not _NOT_FATAL.match(ln)
             and not _strip_log_prefix(ln).startswith(("File ", "^", "Traceback", "raise "))]
    for line in reversed(fatal):
        if any(re.search(p, line) for p in RESOURCE_PATTERNS):
            return _strip_log_prefix(line), False
    for pattern in UNSUPPORTED_PATTERNS:
        for line in fatal:  # the first: the root cause, before the errors it set off
            if re.search(pattern, line):
                return _strip_log_prefix(line), True
    errors = [i for i, ln in enumerate(lines) if re.search(r"(Error|Exception)\b.*:", ln)]
    if not errors:
        return (_strip_log_prefix(lines[-1]) if lines else "no output"), False
    reason = _strip_log_prefix(lines[errors[-1]])
    if re.search(r"validation errors? for \w+$", reason) and errors[-1] + 1 < len(lines):
        reason += ": " + _strip_log_prefix(lines[errors[-1] + 1])  # pydantic: the detail follows
    return reason, False


def _strip_log_prefix(line: str) -> str:
    # "(EngineCore pid=12) ERROR 11-29 09:40:01 [core.py:12] ValueError: ..." -> "ValueError: ..."
    bare = re.sub(r"^(\(.*?\)\s*)?(ERROR|WARNING|INFO)?\s*(\d\d-\d\d [\d:]+\s*)?(\[.*?\]\s*)?",
                  "", line).strip() or line
    return re.sub(r"\s*Reasons:\s*$", "", bare).rstrip(": .")


def _refusal_file(identity: str) -> Path:
    key = hardware.profile().key()
    return paths.artifacts_dir() / "cache" / "unsupported" / f"{identity}-{key}.json"


def known_refusal(identity: str) -> str | None:
    """The reason this vLLM already gave, on this hardware (its profile key: CPU ISA class or
    GPU model and compute capability), for not serving the checkpoint ``identity``; None if
    it never refused it. Spares a minute-long failed start."""
    known = read_json(_refusal_file(identity))
    return known.get("reason") if known.get("vllm") == vllm_version() else None


def remember_refusal(identity: str, reason: str) -> None:
    """Remembered the moment it happens: a run that dies later still keeps what it learnt."""
    write_json_atomic(_refusal_file(identity), {
        "vllm": vllm_version(), "reason": reason, "hardware": hardware.profile().describe(),
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds")})

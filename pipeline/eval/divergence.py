"""Distribution check without labels: how far a variant's next-token distribution moves.

On held-out text (``evals/_heldout/heldout.txt``, written for qpipe; it shares nothing with the
calibration data), both models predict every next token; per token we take
KL(baseline || variant), whether their top-1 tokens agree, and the log-likelihood of the
actual token (perplexity). Computed with transformers in the pipeline environment, so the
variant runs on de-compressed weights: this is an emulated figure, not the served one.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.core import hardware
from pipeline.core.errors import ConfigError
from pipeline.core.fsutil import write_json_atomic
from pipeline.core.heldout import (
    HELDOUT,
    SCAN_SPAN,
    SEQ_LEN,
    heldout_text,
    proof_part,
    token_stats,
    windows,
)

BACKEND = "hf (transformers, de-compressed weights)"


BF16_UNITS = ("avx512_bf16", "amx_bf16")  # CPU flags of bf16 arithmetic in hardware


def hf_dtype() -> str:
    """The dtype models run in under transformers (emulated scoring and this check): bfloat16
    where it runs in hardware (a GPU, a CPU with AVX-512 bf16 or AMX), float32 on a CPU
    without bf16 units, where torch emulates bf16 about 4x slower (a 2-core AVX2-only EPYC,
    2026-12-04: 16.5 s against 4.8 s a forward of 8 x 128 tokens of the embedded model; the
    campaign's eval took 17.5 min in bf16). Both models of a comparison run in the same."""
    if hardware.torch_device() == "cuda" or any(
            f in hardware.profile().cpu_flags for f in BF16_UNITS):
        return "bfloat16"
    return "float32"


@dataclass(frozen=True)
class Divergence:
    """Per-token figures averaged over every predicted token of the held-out text."""

    tokens: int
    kl_div_mean: float  # nats per token, KL(baseline || variant)
    top1_agreement: float  # share of tokens where both models' most likely token is the same
    perplexity: float  # the variant's
    baseline_perplexity: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def device() -> str:
    """Where the check runs: the GPU when there is one (minutes for an 8B model on a host CPU
    without bf16 units, and a 70B does not fit in its RAM), else the CPU."""
    return hardware.torch_device()


def load_model(model_dir: Path) -> Any:
    """The model in :func:`hf_dtype`, its de-compressed weights as compressed-tensors gives
    them."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, hf_dtype())
    # on GPUs accelerate places the layers over every device a large model needs
    placement = {"device_map": "auto"} if device() == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **placement).eval()
    if dtype != torch.bfloat16 and not _runs_in(model):
        _bf16_layers(model, dtype)
    return model


def _runs_in(model: Any) -> bool:
    """Whether a forward pass runs in the dtype the model was loaded in: compressed-tensors
    de-compresses FP4 weights (MXFP4, NVFP4) to bf16 whatever dtype is asked for."""
    import torch

    try:
        with torch.inference_mode():
            model(torch.tensor([[0, 1]], device=model.device))
    except RuntimeError as err:
        if "dtype" not in str(err):
            raise
        return False
    return True


def _bf16_layers(model: Any, dtype: Any) -> None:
    """Each quantized layer computes in bf16, its weights' de-compressed dtype, as the bf16
    path does (its input rounded to bf16, its output back to ``dtype``); the rest in
    ``dtype``."""
    import torch

    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None \
                and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16),
                                                              *args[1:]))
            module.register_forward_hook(lambda _, __, out: out.to(dtype))


def _log_probs(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).cpu()  # kept for every variant: host memory


def _window_log_probs(model: Any, wins: list[list[int]]) -> list[Any]:
    return [_log_probs(model, window) for window in wins]


def _summarize(base_lps: list[Any], var_lps: list[Any], wins: list[list[int]]) -> Divergence:
    import torch

    kl_sum = agree_sum = nll_base = nll_var = 0.0
    count = 0
    for base_lp, var_lp, window in zip(base_lps, var_lps, wins, strict=True):
        stats = token_stats(base_lp, var_lp, torch.tensor(window[1:]))
        kl_sum += float(stats["kl"].sum())  # >= 0 up to float error: not clamped, not hidden
        agree_sum += float(stats["agree"].sum())
        nll_base += float(stats["nll_base"].sum())
        nll_var += float(stats["nll_var"].sum())
        count += len(window) - 1
    if count == 0:
        raise ConfigError("the held-out text tokenizes to fewer than 2 tokens. Fix: use a longer "
                          "text.")
    return Divergence(tokens=count, kl_div_mean=kl_sum / count, top1_agreement=agree_sum / count,
                      perplexity=math.exp(nll_var / count),
                      baseline_perplexity=math.exp(nll_base / count))


def measure_all(baseline_dir: Path, variants: dict[Path, Path], text_path: Path = HELDOUT,
                seq_len: int = SEQ_LEN, skip: int = SCAN_SPAN) -> dict[Path, Divergence]:
    """KL, top-1 agreement and perplexities against the baseline of each variant directory ->
    its cache file, cached there (the baseline itself: its own perplexity), on the held-out
    text after its first ``skip`` tokens (the precision search's scan part). The baseline's
    log-probabilities are computed once and kept for every variant (the forward passes are
    most of the cost: ~3 s per 512-token window of a 135M model in bf16 on 2 cores)."""
    from transformers import AutoTokenizer

    results = {variant_dir: Divergence(**json.loads(cache.read_text()))
               for variant_dir, cache in variants.items() if cache.is_file()}
    todo = [v for v in variants if v not in results]
    if not todo:
        return results
    text = heldout_text(text_path)
    tokenizer = AutoTokenizer.from_pretrained(baseline_dir)
    wins = windows(proof_part(tokenizer(text, add_special_tokens=True).input_ids, skip),
                   seq_len)
    base = load_model(baseline_dir)
    base_lps = _window_log_probs(base, wins)
    for variant_dir in todo:
        if variant_dir.resolve() == baseline_dir.resolve():
            var_lps = base_lps
        else:
            var = load_model(variant_dir)
            if var.config.vocab_size != base.config.vocab_size:
                raise ConfigError(
                    f"{variant_dir} has a vocabulary of {var.config.vocab_size} tokens and the "
                    f"baseline {base.config.vocab_size}: their distributions cannot be "
                    "compared. Fix: compare a variant of this baseline.")
            var_lps = _window_log_probs(var, wins)
            del var
        results[variant_dir] = _summarize(base_lps, var_lps, wins)
        write_json_atomic(variants[variant_dir], results[variant_dir].as_dict())
    return results


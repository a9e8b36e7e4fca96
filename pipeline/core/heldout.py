"""The held-out text both the divergence check and the precision search score on
(``evals/_heldout/heldout.txt``, written for qpipe; it shares nothing with the calibration data),
its windows, and the per-token statistics of two models' log-probabilities on it."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pipeline.core import paths
from pipeline.core.errors import ConfigError

HELDOUT = paths.EVALS_DIR / "_heldout" / "heldout.txt"
SEQ_LEN = 512


def heldout_text(path: Path = HELDOUT) -> str:
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the held-out text ({err.strerror}). Fix: restore "
                          "it from git, or pass another text file.") from None
    if len(text.split()) < 50:
        raise ConfigError(f"{path}: the held-out text has fewer than 50 words. Fix: use a text "
                          "of at least a few hundred words.")
    return text


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def windows(token_ids: list[int], seq_len: int = SEQ_LEN) -> list[list[int]]:
    """Consecutive windows of at most ``seq_len`` tokens; each predicts its tokens 2..n."""
    out = [token_ids[i:i + seq_len] for i in range(0, len(token_ids), seq_len)]
    return [w for w in out if len(w) >= 2]


def token_stats(base_lp: Any, var_lp: Any, targets: Any) -> dict[str, Any]:
    """Per-position KL(base || var), top-1 agreement and both models' NLL of ``targets``."""
    kl = (base_lp.exp() * (base_lp - var_lp)).sum(-1)
    agree = base_lp.argmax(-1) == var_lp.argmax(-1)
    idx = targets.unsqueeze(-1)
    return {"kl": kl, "agree": agree, "nll_base": -base_lp.gather(-1, idx).squeeze(-1),
            "nll_var": -var_lp.gather(-1, idx).squeeze(-1)}

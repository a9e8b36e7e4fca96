"""The held-out text the precision search and the divergence check score on
(``evals/_heldout/heldout.txt``, written for qpipe; it shares nothing with the calibration data),
its windows, and the per-token statistics of two models' log-probabilities on it.

The two use disjoint parts of it: the search's scan (which chooses the units) the first
``SCAN_SPAN`` tokens, the divergence check (the proof of what was chosen) the tokens after, so
that a choice is never checked on the text it was selected on."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from pipeline.core import paths
from pipeline.core.errors import ConfigError

HELDOUT = paths.EVALS_DIR / "_heldout" / "heldout.txt"
SEQ_LEN = 512
SCAN_SPAN = 1024  # the scan's tokens: the first two 512-token windows; the check's start after


def scan_part(token_ids: list[int], tokens: int = SCAN_SPAN) -> list[int]:
    """The first ``tokens`` (at most ``SCAN_SPAN``) tokens: what the scan scores units on."""
    if tokens > SCAN_SPAN:
        raise ConfigError(f"SCAN_TOKENS={tokens}: the scan's part of the held-out text is its "
                          f"first {SCAN_SPAN:,} tokens (the rest checks the searched recipes). "
                          f"Fix: SCAN_TOKENS={SCAN_SPAN} or fewer.")
    return token_ids[:tokens]


def proof_part(token_ids: list[int], skip: int = SCAN_SPAN) -> list[int]:
    """The tokens after the scan's part: what the divergence check measures on."""
    return token_ids[skip:]


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

"""A file of the user's own prompts (``dataset: custom``), checked before vLLM's client reads it.

The format is the one ``vllm bench serve --dataset-name custom`` reads: JSON Lines, one request
per line, ``{"prompt": "...", "output_tokens": 120}``; ``output_tokens`` (the answer's length
in tokens, as served in production) is needed unless the workload sets ``output_len`` for all.
The client sends each prompt through the model's chat template. A line that is not such an
object is an error naming the file and the line, here, not a pandas traceback in the client.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from pipeline.core.errors import ConfigError

FORMAT = '{"prompt": "...", "output_tokens": N}'


def check(path: Path, needs_output: bool) -> Path:
    """``path`` if every line is a request; else a ConfigError naming the line."""
    _read(path, needs_output)
    return path


def longest_output(path: Path) -> int:
    """The longest ``output_tokens`` in the file (0 when none is given)."""
    return max((r.get("output_tokens", 0) for r in _read(path, False)), default=0)


@cache
def _read(path: Path, needs_output: bool) -> tuple[dict, ...]:
    if path.suffix != ".jsonl":
        raise ConfigError(f"{path}: a prompt file is JSON Lines (.jsonl), one {FORMAT} per "
                          "line (docs/workloads.md says how to export one from logs).")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the prompt file ({err.strerror}).") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a prompt file is JSON Lines.") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err.msg}); each line is one {FORMAT}."
                              ) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
                or not record["prompt"].strip():
            raise ConfigError(f"{where}: no non-empty string \"prompt\"; each line is one "
                              f"{FORMAT}.")
        tokens = record.get("output_tokens")
        if tokens is None and needs_output:
            raise ConfigError(f"{where}: no \"output_tokens\": give each request its answer's "
                              "length, or set output_len in the workload for all of them.")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                   or tokens <= 0):
            raise ConfigError(f"{where}: \"output_tokens\" is a positive integer, not "
                              f"{tokens!r}.")
        records.append(record)
    if not records:
        raise ConfigError(f"{path}: no request in the prompt file; each line is one {FORMAT}.")
    return tuple(records)

"""The user's own request files, checked before vLLM's client reads them: a line that is not a
request is an error naming the file and the line, here, not a traceback in the client.

- prompts (``dataset: custom``), the format ``vllm bench serve --dataset-name custom`` reads:
  JSON Lines, ``{"prompt": "...", "output_tokens": 120}``; ``output_tokens`` (the answer's
  length as served in production) is needed unless the workload sets ``output_len`` for all.
  The client sends each prompt through the model's chat template.
- a timed trace (``dataset: timed_trace``), ``--dataset-name timed_trace``: JSON Lines,
  ``{"timestamp": 0.31, "input_length": 180, "output_length": 40, "hash_ids": [1, 2]}``
  (seconds; requests sharing a hash id share that chunk of prompt tokens), replayed at its own
  arrival times. Only lengths and timing: the client makes the tokens.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from pipeline.core.errors import ConfigError

FORMAT = '{"prompt": "...", "output_tokens": N}'
TRACE_FORMAT = '{"timestamp": S, "input_length": N, "output_length": N, "hash_ids": [...]}'


def check(path: Path, needs_output: bool) -> Path:
    """``path`` if every line is a prompt; else a ConfigError naming the line."""
    _read(path, needs_output)
    return path


def longest_output(path: Path) -> int:
    """The longest ``output_tokens`` in the file (0 when none is given)."""
    return max((r.get("output_tokens", 0) for r in _read(path, False)), default=0)


def check_trace(path: Path, chunk: int = 16) -> Path:
    """``path`` if every line is a timed request, in time order, whose ``hash_ids`` cover its
    prompt (vLLM builds a prompt of ``chunk`` tokens per id, and no more); else a
    ConfigError naming the line."""
    for number, record in enumerate(_read_trace(path), start=1):
        need = -(-record["input_length"] // chunk)
        if len(record.get("hash_ids", [])) < need:
            raise ConfigError(
                f"{path}: request {number} (line order) has {len(record.get('hash_ids', []))} "
                f"hash_ids for {record['input_length']} prompt tokens: vLLM's client builds "
                f"{chunk} tokens per id, so it needs {need} (the same id in two requests: the "
                "same chunk of prompt; trace_chunk_size sets the tokens per id).")
    return path


def trace_requests(path: Path) -> int:
    return len(_read_trace(path))


def trace_longest(path: Path) -> int:
    """The longest request of the trace, prompt and output (max_model_len must hold it)."""
    return max(r["input_length"] + r["output_length"] for r in _read_trace(path))


def _records(path: Path, what: str, shape: str) -> list[tuple[str, dict]]:
    """(where, object) for each non-empty line of a JSON Lines file."""
    if path.suffix != ".jsonl":
        raise ConfigError(f"{path}: a {what} is JSON Lines (.jsonl), one {shape} per "
                          "line (docs/workloads.md says how to export one from logs).")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the {what} ({err.strerror}).") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a {what} is JSON Lines.") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not JSON ({err.msg}); each line is one {shape}."
                              ) from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: not a JSON object; each line is one {shape}.")
        out.append((where, record))
    if not out:
        raise ConfigError(f"{path}: no request in the {what}; each line is one {shape}.")
    return out


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@cache
def _read_trace(path: Path) -> tuple[dict, ...]:
    records, last = [], float("-inf")
    for where, record in _records(path, "timed trace", TRACE_FORMAT):
        stamp = record.get("timestamp")
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp < 0:
            raise ConfigError(f"{where}: \"timestamp\" is the request's arrival in seconds "
                              f"(>= 0), not {stamp!r}; each line is one {TRACE_FORMAT}.")
        if stamp < last:
            raise ConfigError(f"{where}: timestamp {stamp} is earlier than the line before "
                              f"({last}); a trace is in arrival order.")
        last = stamp
        for key in ("input_length", "output_length"):
            if not _positive_int(record.get(key)):
                raise ConfigError(f"{where}: \"{key}\" is a positive number of tokens, not "
                                  f"{record.get(key)!r}.")
        hashes = record.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise ConfigError(f"{where}: \"hash_ids\" is a list of integers (chunks of prompt "
                              "shared between requests), or absent.")
        records.append(record)
    return tuple(records)


@cache
def _read(path: Path, needs_output: bool) -> tuple[dict, ...]:
    records = []
    for where, record in _records(path, "prompt file", FORMAT):
        if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ConfigError(f"{where}: no non-empty string \"prompt\"; each line is one "
                              f"{FORMAT}.")
        tokens = record.get("output_tokens")
        if tokens is None and needs_output:
            raise ConfigError(f"{where}: no \"output_tokens\": give each request its answer's "
                              "length, or set output_len in the workload for all of them.")
        if tokens is not None and not _positive_int(tokens):
            raise ConfigError(f"{where}: \"output_tokens\" is a positive integer, not "
                              f"{tokens!r}.")
        records.append(record)
    return tuple(records)

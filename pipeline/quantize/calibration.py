"""Calibration data for recipes that need it: a local JSONL/JSON/parquet/CSV file or a hub id.

Rows carry a ``text`` column, or ``messages`` in chat format (rendered with the model's chat
template). A fixed seed picks the samples, so the same recipe sees the same data every time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core import log as qlog
from pipeline.core.errors import ConfigError
from pipeline.quantize.recipes import Calibration

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

log = qlog.get("quantize")


def load(calibration: Calibration, tokenizer: Any) -> Any:
    """A ``datasets.Dataset`` with one ``text`` column and at most ``num_samples`` rows."""
    import datasets

    source = calibration.dataset
    path = Path(source).expanduser()
    try:
        if path.suffix in LOCAL_FORMATS:
            if not path.is_file():
                raise ConfigError(f"calibration dataset {path} does not exist: fix "
                                  "calibration.dataset in the recipe, or CALIB_DATA=.")
            data = datasets.load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path),
                                         split="train")
        else:
            data = datasets.load_dataset(source, split="train")
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(
            f"calibration dataset {source!r} could not be read ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Use a local .jsonl/.json/.parquet/"
            ".csv file with a `text` column, or a hub id where a hub is reachable."
        ) from None
    if len(data) == 0:
        raise ConfigError(f"calibration dataset {source} is empty.")
    if "text" not in data.column_names:
        if "messages" not in data.column_names:
            raise ConfigError(f"calibration dataset {source} has columns {data.column_names}; "
                              "it needs `text` (plain text) or `messages` (chat format).")
        data = data.map(
            lambda row: {"text": tokenizer.apply_chat_template(row["messages"], tokenize=False)},
        )
    data = data.select_columns(["text"]).shuffle(seed=calibration.seed)
    for note in caps(calibration, len(data),
                     max(len(tokenizer(t).input_ids) for t in data["text"][:256])):
        log.info(f"calibration: {note}")
    return data.select(range(min(calibration.num_samples, len(data))))


def caps(calibration: Calibration, rows: int, longest_tokens: int) -> list[str]:
    """What the data itself limits below what was asked (said, never silently applied)."""
    notes = []
    if calibration.num_samples > rows:
        notes.append(f"{calibration.dataset} has {rows} samples, fewer than the "
                     f"{calibration.num_samples} asked (CALIB_SAMPLES): all {rows} are used. "
                     "For more, point CALIB_DATA= at a larger file or a hub dataset "
                     "(docs/quantize.md, Recipes)")
    if calibration.max_seq_length > longest_tokens:
        notes.append(f"its longest sample is {longest_tokens} tokens, shorter than the "
                     f"{calibration.max_seq_length} asked (CALIB_SEQ_LEN): samples are not "
                     "padded or joined, so none reaches that length")
    return notes

"""Progress lines through Python logging: ``[stage] message`` on stdout for a person at a
terminal, levels for everyone else (``QPIPE_LOG_LEVEL=WARNING`` quiets a run)."""

from __future__ import annotations

import logging
import os
import sys

ROOT = "qpipe"


class _Stdout(logging.StreamHandler):
    """Writes to the current ``sys.stdout`` (which tests and pipes may replace)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stage = record.name.rsplit(".", 1)[-1]
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"[{stage}] {level}{record.getMessage()}"


def get(stage: str) -> logging.Logger:
    """The logger of a stage (``[stage]`` lines)."""
    root = logging.getLogger(ROOT)
    if not root.handlers:
        handler = _Stdout()
        handler.setFormatter(_Format())
        root.addHandler(handler)
        root.setLevel(os.environ.get("QPIPE_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(f"{ROOT}.{stage}")

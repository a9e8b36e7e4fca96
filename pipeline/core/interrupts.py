"""Ctrl-C and SIGTERM as one remembered event, not only an exception.

Python delivers a signal as an exception raised wherever the main thread happens to be. When
that is a weakref callback or a ``__del__`` (torch and transformers run many), the interpreter
prints "Exception ignored" and carries on, so a run could finish and publish its output after
the user asked it to stop. The handler therefore also records the signal, and the places that
publish output or report success call :func:`check` first.
"""

from __future__ import annotations

import signal
from types import FrameType

_received: int | None = None


def _handler(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = signum
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install() -> None:
    """Route SIGINT and SIGTERM through the remembering handler (main thread only)."""
    global _received
    _received = None
    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if an interrupt arrived, even one a library swallowed."""
    if _received is not None:
        raise KeyboardInterrupt(signal.Signals(_received).name)

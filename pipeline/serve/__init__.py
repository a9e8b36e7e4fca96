"""Serving: a vLLM server's lifecycle, the pool a campaign shares, why an engine failed."""

from pipeline.serve.failure import (
    ServeError,
    TooSlow,
    UnsupportedFormat,
    is_too_slow,
    known_refusal,
    remember_refusal,
)
from pipeline.serve.pool import ServerPool
from pipeline.serve.server import VllmServer
from pipeline.serve.settings import EngineSettings

__all__ = ["EngineSettings", "ServeError", "ServerPool", "TooSlow", "UnsupportedFormat",
           "VllmServer", "is_too_slow", "known_refusal", "remember_refusal"]

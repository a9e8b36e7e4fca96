"""Serving: a vLLM server's lifecycle, the pool a campaign shares, why an engine failed."""

from pipeline.serve.failure import ServeError, UnsupportedFormat, known_refusal, remember_refusal
from pipeline.serve.pool import ServerPool
from pipeline.serve.server import VllmServer
from pipeline.serve.settings import EngineSettings

__all__ = ["EngineSettings", "ServeError", "ServerPool", "UnsupportedFormat", "VllmServer",
           "known_refusal", "remember_refusal"]

"""Bench: serve every model through vLLM and load-test it with vLLM's own client."""

from pipeline.bench.settings import BenchSettings
from pipeline.bench.stage import bench, run

__all__ = ["BenchSettings", "bench", "run"]

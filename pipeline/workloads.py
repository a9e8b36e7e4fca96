"""Workload files (``configs/workloads/*.yaml``) and the ``vllm bench serve`` command for each.

A workload names the context-length distribution, the load points (max concurrency), how
many requests each gets, the repeats and the seed. qpipe does not generate load itself: each
load point is one run of vLLM's own benchmark client.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline import paths
from pipeline.errors import ConfigError

WORKLOADS_DIR = paths.CONFIGS_DIR / "workloads"
DEFAULT_WORKLOADS = ("chat", "prefix")
DATASETS = ("random", "prefix_repetition")
PERCENTILES = "50,99"


@dataclass(frozen=True)
class Workload:
    name: str
    path: Path
    sha256: str
    description: str
    dataset: str
    load_points: tuple[int, ...]
    headline: int
    repeats: int
    seed: int
    prompts_per_concurrency: int
    min_prompts: int
    output_len: int
    input_len: int = 0  # random
    range_ratio: float = 0.0  # random
    prefix_len: int = 0  # prefix_repetition
    suffix_len: int = 0
    num_prefixes: int = 1
    compare_prefix_caching: bool = False
    # which models run it: every one, or only the baseline (what prefix reuse buys is mostly
    # the engine's, not the precision's)
    models: str = "all"
    # with caching off, every model it runs on or only the baseline (a restart each)
    prefix_off_models: str = "all"

    def runs_on(self, model_name: str) -> bool:
        return self.models == "all" or model_name == "baseline"

    def runs_off(self, model_name: str) -> bool:
        return self.runs_on(model_name) and (self.prefix_off_models == "all"
                                             or model_name == "baseline")

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)

    @property
    def max_tokens_per_request(self) -> int:
        """Longest prompt + output this workload sends (the engine's max_model_len must fit)."""
        if self.dataset == "random":
            return int(self.input_len * (1 + self.range_ratio)) + int(
                self.output_len * (1 + self.range_ratio)) + 1
        return self.prefix_len + self.suffix_len + self.output_len

    def client_args(self, concurrency: int) -> list[str]:
        """Arguments of ``vllm bench serve`` that describe this load point."""
        args = ["--dataset-name", self.dataset, "--num-prompts", str(self.num_prompts(concurrency)),
                "--max-concurrency", str(concurrency), "--request-rate", "inf",
                "--seed", str(self.seed), "--ignore-eos",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES]
        if self.dataset == "random":
            args += ["--random-input-len", str(self.input_len),
                     "--random-output-len", str(self.output_len),
                     "--random-range-ratio", str(self.range_ratio)]
        else:
            args += ["--prefix-repetition-prefix-len", str(self.prefix_len),
                     "--prefix-repetition-suffix-len", str(self.suffix_len),
                     "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                     "--prefix-repetition-output-len", str(self.output_len)]
        return args


FIELDS = {"description": str, "dataset": str, "load_points": list, "headline": int,
          "repeats": int, "seed": int, "prompts_per_concurrency": int, "min_prompts": int,
          "output_len": int, "input_len": int, "range_ratio": (int, float), "prefix_len": int,
          "suffix_len": int, "num_prefixes": int, "compare_prefix_caching": bool,
          "models": str, "prefix_off_models": str}
REQUIRED = {"random": ("input_len", "output_len"),
            "prefix_repetition": ("prefix_len", "suffix_len", "output_len")}


def find(name_or_path: str) -> Path:
    found = paths.find_yaml(name_or_path, WORKLOADS_DIR)
    if found:
        return found
    known = ", ".join(paths.yaml_names(WORKLOADS_DIR))
    raise ConfigError(f"unknown workload {name_or_path!r}: the workloads in {WORKLOADS_DIR} are "
                      f"{known}. Set WORKLOAD= to one of them or to a workload YAML file.")


def load(name_or_path: str) -> Workload:
    path = find(name_or_path)
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML ({getattr(err, 'problem', err)}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a workload is a YAML mapping of {', '.join(FIELDS)}.")
    for key, value in data.items():
        if key not in FIELDS:
            raise ConfigError(f"{path}: unknown field {key!r}; the fields are {', '.join(FIELDS)}.")
        expected = FIELDS[key]
        if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
            raise ConfigError(f"{path}: field {key!r} has the wrong type ({value!r}).")
    dataset = data.get("dataset", "random")
    if dataset not in DATASETS:
        raise ConfigError(f"{path}: dataset {dataset!r} is not one of {', '.join(DATASETS)}.")
    for key in REQUIRED[dataset]:
        if not isinstance(data.get(key), int) or data[key] <= 0:
            raise ConfigError(f"{path}: {dataset} needs a positive integer {key!r}.")
    points = data.get("load_points", [1])
    if not points or not all(isinstance(p, int) and p > 0 for p in points):
        raise ConfigError(f"{path}: load_points must be positive integers (max concurrency).")
    headline = data.get("headline", points[0])
    if headline not in points:
        raise ConfigError(f"{path}: headline {headline} is not one of the load_points {points}.")
    for key in ("models", "prefix_off_models"):
        if data.get(key, "all") not in ("all", "baseline"):
            raise ConfigError(f"{path}: {key} is 'all' or 'baseline', not {data[key]!r}.")
    values: dict[str, Any] = {k: v for k, v in data.items() if k not in ("load_points",)}
    values.update(load_points=tuple(points), headline=headline, dataset=dataset,
                  description=str(data.get("description", "")),
                  repeats=max(1, int(data.get("repeats", 3))), seed=int(data.get("seed", 0)),
                  prompts_per_concurrency=int(data.get("prompts_per_concurrency", 4)),
                  min_prompts=int(data.get("min_prompts", 8)))
    return Workload(name=path.stem, path=path, sha256=hashlib.sha256(text.encode()).hexdigest(),
                    **values)

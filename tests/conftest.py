"""Shared fixtures: an isolated artifacts dir and MLflow store, and a tiny Llama made in-test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import paths

CALIBRATION = paths.CALIBRATION_DIR / "python-reference.jsonl"
# A short sweep for a tiny model through vLLM CPU: two load points, two repeats.
TINY_LOAD = """\
description: tiny sweep
dataset: random
input_len: 32
output_len: 8
load_points: [1, 2]
headline: 2
min_prompts: 4
prompts_per_concurrency: 2
repeats: 2
seed: 7
"""

# A campaign of two recipes on the tiny model, no bench stage (its serving path is tested in
# test_bench; here it would add minutes): the comparison shows those variants as "not benched",
# which is also what a user sees before `make bench`.
TINY_CAMPAIGN = """\
description: tiny end-to-end campaign
recipes: [fp8, mxfp4]
workloads: []
suites: [app]
limit: 8
backend: hf
divergence: false
plan: {gpu: h100-80gb, context: 512, max_context: 1024}
"""

# `make test` runs on TEST_JOBS pytest-xdist workers (--dist loadgroup). Tests that hold a
# machine-wide resource share an ``xdist_group`` and so run one after another on one worker:
# "servers": three or more vLLM servers at once (~3 GB each: two workers' worth would not fit
#            the 24 GiB machine), and the Ray tests (one Ray cluster per machine);
# "embedded": the embedded model's conversion into the project's own artifacts dir.
# fixtures that make a test slow (a model made, loaded or served) or need a system service
SLOW_FIXTURES = {"tiny_model"}
SERVICE_FIXTURES = {"postgres_uri", "chromium_path", "mlflow_server"}


# marks a grouped test that pytest-xdist did not put in its group (it then fails at once)
GROUP_LOST = "qpipe_group_lost"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which names each test's group
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by what a test uses, so `make test-fast` cannot pick up a slow one by omission;
    under ``--dist loadgroup``, mark each grouped test that did not get its group."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if used & SERVICE_FIXTURES:
            item.add_marker(pytest.mark.services)
        if config.getoption("loadgroup", False) and item.get_closest_marker("xdist_group") \
                and "@" not in item.nodeid:  # xdist appends "@<group>" in each worker
            item.add_marker(GROUP_LOST)


@pytest.fixture(autouse=True)
def _in_its_group(request: pytest.FixtureRequest) -> None:
    """Fail a grouped test that pytest-xdist did not put in its group, before it starts."""
    if request.node.get_closest_marker(GROUP_LOST):
        pytest.fail(f"pytest-xdist did not put this test in its xdist_group under --dist "
                    f"loadgroup (pytest {pytest.__version__} with this pytest-xdist): grouped "
                    "tests would run at once on two workers (two Ray clusters, too many vLLM "
                    "servers). Install the pinned pytest: pip install -r "
                    "requirements/pipeline.txt", pytrace=False)


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Artifacts and the MLflow store under a temp dir, as ARTIFACTS= / MLFLOW_TRACKING_URI= do."""
    monkeypatch.setenv("QPIPE_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in CALIBRATION.read_text().splitlines()[:60]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="</s>").save_pretrained(out)


def make_tiny_llama(out: Path, hidden: int = 128, seed: int = 0) -> Path:
    """A 2-layer Llama (head_dim 64, as vLLM CPU kernels expect) with a BPE tokenizer made here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    _train_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``qpipe ARGS`` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=paths.PROJECT_ROOT)

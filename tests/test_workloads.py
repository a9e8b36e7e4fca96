from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import workloads
from pipeline.errors import ConfigError


def test_shipped_workloads_load_and_describe_a_client_run() -> None:
    chat = workloads.load("chat")
    assert chat.dataset == "random" and chat.headline in chat.load_points
    assert chat.repeats >= 3
    args = chat.client_args(16)
    assert args[args.index("--max-concurrency") + 1] == "16"
    assert args[args.index("--num-prompts") + 1] == str(
        max(chat.min_prompts, chat.prompts_per_concurrency * 16))
    assert args[args.index("--seed") + 1] == str(chat.seed)
    prefix = workloads.load("prefix")
    assert prefix.compare_prefix_caching and prefix.prefix_len % 128 == 0
    assert "--prefix-repetition-prefix-len" in prefix.client_args(4)
    assert prefix.max_tokens_per_request == 512 + 64 + 16


@pytest.mark.parametrize("body, message", [
    ("dataset: sharegpt\n", "not one of"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nload_points: [1, 4]\nheadline: 2\n",
     "headline 2 is not one of"),
    ("dataset: random\noutput_len: 8\n", "needs a positive integer 'input_len'"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nconcurency: 4\n", "unknown field"),
    ("dataset: random\ninput_len: eight\noutput_len: 8\n", "wrong type"),
    ("dataset: random: x\n", "line 1"),
])
def test_bad_workloads_name_the_file_and_field(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        workloads.load(str(path))
    assert message in str(err.value) and str(path) in str(err.value)


def test_unknown_workload_lists_the_shipped_ones() -> None:
    with pytest.raises(ConfigError, match="chat, prefix"):
        workloads.load("nope")

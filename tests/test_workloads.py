from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench import workloads
from pipeline.core.errors import ConfigError


def test_shipped_workloads_load_and_describe_a_client_run() -> None:
    chat = workloads.load("chat")
    assert chat.dataset == "random" and chat.headline in chat.load_points
    assert chat.repeats >= 2 and chat.max_repeats > chat.repeats  # sequential past the first look
    assert chat.looks("cpu").last == chat.max_repeats and chat.looks("cuda").last == chat.repeats
    args = chat.client_args(16)
    assert args[args.index("--max-concurrency") + 1] == "16"
    assert int(args[args.index("--num-prompts") + 1]) == chat.num_prompts(16) >= max(
        chat.min_prompts, chat.prompts_per_concurrency * 16)
    # every repeat and load point draws its own prompts; every model gets the same ones
    seeds = {(c, r): chat.client_args(c, r)[chat.client_args(c, r).index("--seed") + 1]
             for c in chat.load_points for r in range(chat.max_repeats)}
    assert len(set(seeds.values())) == len(seeds)
    assert chat.client_args(4, 1) == chat.client_args(4, 1)
    prefix = workloads.load("prefix")
    assert prefix.compare_prefix_caching and prefix.prefix_len % 128 == 0
    assert "--prefix-repetition-prefix-len" in prefix.client_args(4)
    assert prefix.max_tokens_per_request == 512 + 64 + prefix.output_len
    # prefix reuse is measured on the baseline; the chat sweep runs on every model
    assert prefix.runs_on("baseline") and prefix.runs_off("baseline")
    assert not prefix.runs_on("int8") and not prefix.runs_off("int8")
    assert chat.runs_on("int8")


def test_models_and_prefix_off_models_choose_who_runs_a_workload(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("dataset: prefix_repetition\nprefix_len: 128\nsuffix_len: 8\noutput_len: 4\n"
                    "compare_prefix_caching: true\nprefix_off_models: baseline\n")
    every = workloads.load(str(path))
    assert every.runs_on("int8") and not every.runs_off("int8") and every.runs_off("baseline")


@pytest.mark.parametrize("body, message", [
    ("dataset: sharegpt\n", "not one of"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nload_points: [1, 4]\nheadline: 2\n",
     "headline 2 is not one of"),
    ("dataset: random\noutput_len: 8\n", "needs a positive integer 'input_len'"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nconcurency: 4\n", "unknown field"),
    ("dataset: random\ninput_len: eight\noutput_len: 8\n", "wrong type"),
    ("dataset: random: x\n", "line 1"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nmodels: variants\n",
     "models is 'all' or 'baseline'"),
    # a number out of range is refused, not clamped or taken as "not set"
    ("dataset: random\ninput_len: 8\noutput_len: 8\nrepeats: 0\n",
     "field 'repeats' must be at least 1 (got 0)"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nrange_ratio: 1.5\n",
     "field 'range_ratio' must be between 0 and 0.999 (got 1.5)"),
    ("dataset: random\ninput_len: 8\noutput_len: 8\nslo: {ttft_ms: 9}\nsearch_precision: 0.1\n",
     "field 'search_precision' is no longer read"),
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


def test_each_point_gets_enough_work_and_the_prefix_share_is_what_blocks_allow(
        tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("dataset: random\ninput_len: 64\noutput_len: 16\nload_points: [1, 8]\n"
                    "min_prompts: 1\nprompts_per_concurrency: 1\nmin_output_tokens: 128\n")
    w = workloads.load(str(path))
    assert w.num_prompts(1) == 8 and w.num_prompts(8) == 8  # 8 x 16 = 128 tokens either way
    assert w.expected_prefix_hit_rate(128, 1) == 0.0
    prefix = workloads.load("prefix")
    n = prefix.num_prompts(prefix.headline)
    per_prefix = n // prefix.num_prefixes
    expected = (per_prefix * prefix.num_prefixes - prefix.num_prefixes) / (
        per_prefix * prefix.num_prefixes) * 512 / (512 + 64)
    assert prefix.expected_prefix_hit_rate(128, prefix.headline) == pytest.approx(expected)
    # only whole blocks are reused: a 200-token prefix with 128-token blocks shares 128
    path.write_text("dataset: prefix_repetition\nprefix_len: 200\nsuffix_len: 56\n"
                    "output_len: 4\nnum_prefixes: 1\nmin_prompts: 4\n"
                    "compare_prefix_caching: true\n")
    assert workloads.load(str(path)).expected_prefix_hit_rate(128, 1) == pytest.approx(
        3 / 4 * 128 / 256)
    path.write_text("dataset: prefix_repetition\nprefix_len: 200\nsuffix_len: 56\n"
                    "output_len: 4\n")
    with pytest.raises(ConfigError, match="compare_prefix_caching: true"):
        workloads.load(str(path))


CUSTOM = "dataset: custom\nprompts: p.jsonl\nload_points: [1, 2]\n"


def test_a_prompt_file_workload_replays_the_users_requests(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hi there", "output_tokens": 12}\n\n'
                                      '{"prompt": "Summarize: ...", "output_tokens": 40}\n')
    (tmp_path / "w.yaml").write_text(CUSTOM)
    w = workloads.load(str(tmp_path / "w.yaml"))
    assert w.prompts == str(tmp_path / "p.jsonl") and len(w.file_sha256) == 64
    assert w.max_tokens_per_request == 40  # the longest output; the client counts prompts
    args = w.client_args(2, repeat=1)
    assert args[args.index("--dataset-name") + 1] == "custom"
    assert args[args.index("--dataset-path") + 1] == w.prompts
    assert args[args.index("--custom-output-len") + 1] == "-1"  # each request's own length
    assert "--save-detailed" in args  # the lengths sent, for the report
    (tmp_path / "w.yaml").write_text(CUSTOM + "output_len: 8\n")
    args = workloads.load(str(tmp_path / "w.yaml")).client_args(2)
    assert args[args.index("--custom-output-len") + 1] == "8"


@pytest.mark.parametrize("lines, line, message", [
    ('{"prompt": "ok", "output_tokens": 3}\n{"prompt": "no closing"\n', 2, "not JSON"),
    ('{"prompt": "ok", "output_tokens": 3}\n{"text": "x", "output_tokens": 3}\n', 2, '"prompt"'),
    ('{"prompt": "", "output_tokens": 3}\n', 1, '"prompt"'),
    ('{"prompt": "ok"}\n', 1, "output_tokens"),
    ('{"prompt": "ok", "output_tokens": -4}\n', 1, "positive integer"),
    ('["prompt", "ok"]\n', 1, "not a JSON object"),
])
def test_a_malformed_prompt_file_names_the_line(tmp_path: Path, lines: str, line: int,
                                                message: str) -> None:
    _assert_names_the_line(tmp_path, CUSTOM, "p.jsonl", lines, line, message)


def _assert_names_the_line(tmp_path: Path, workload: str, name: str, lines: str, line: int,
                           message: str) -> None:
    """A workload over a malformed request file: an error matching ``message`` at the line."""
    (tmp_path / name).write_text(lines)
    (tmp_path / "w.yaml").write_text(workload)
    with pytest.raises(ConfigError, match=message) as err:
        workloads.load(str(tmp_path / "w.yaml"))
    assert f"{tmp_path / name}, line {line}:" in str(err.value)


def test_a_missing_or_empty_prompt_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "w.yaml").write_text(CUSTOM)
    with pytest.raises(ConfigError, match="cannot read the prompt file"):
        workloads.load(str(tmp_path / "w.yaml"))
    (tmp_path / "p.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no request"):
        workloads.load(str(tmp_path / "w.yaml"))
    (tmp_path / "w.yaml").write_text("dataset: custom\nload_points: [1]\n")
    with pytest.raises(ConfigError, match="names its prompt file"):
        workloads.load(str(tmp_path / "w.yaml"))


def test_the_shipped_sample_traffic_loads() -> None:
    w = workloads.load("traffic")
    assert w.dataset == "custom" and Path(w.prompts).name == "sample-prompts.jsonl"
    assert 20 <= len(Path(w.prompts).read_text().splitlines()) <= 200


TRACE = "dataset: timed_trace\ntrace: t.jsonl\nload_points: [8]\n"


def test_a_timed_trace_is_replayed_whole_at_its_own_pace(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 20, "hash_ids": [1, 2]}\n'
        '{"timestamp": 0.5, "input_length": 300, "output_length": 50, "hash_ids": [3, 4, 5]}\n'
        '{"timestamp": 0.5, "input_length": 40, "output_length": 8, "hash_ids": [1]}\n')
    (tmp_path / "w.yaml").write_text(TRACE + "trace_sec_multiplier: 0.001\n"
                                     "trace_chunk_size: 100\n")
    w = workloads.load(str(tmp_path / "w.yaml"))
    assert w.num_prompts(8) == 3  # the whole trace, whatever the load point
    assert w.max_tokens_per_request == 350
    args = w.client_args(8)
    assert args[args.index("--dataset-name") + 1] == "timed_trace"
    assert args[args.index("--dataset-path") + 1] == str(tmp_path / "t.jsonl")
    assert args[args.index("--timed-trace-sec-multiplier") + 1] == "0.001"
    assert args[args.index("--num-warmups") + 1] == "4"
    assert args[args.index("--timed-trace-chunk-hash-size") + 1] == "100"
    # with vLLM's default 16 tokens per id, 2 ids cannot make a 100-token prompt
    (tmp_path / "w.yaml").write_text(TRACE)
    with pytest.raises(ConfigError, match=r"request 1 .* has 2 hash_ids for 100 prompt tokens"):
        workloads.load(str(tmp_path / "w.yaml"))


@pytest.mark.parametrize("lines, line, message", [
    ('{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n'
     '{"timestamp": 0.5, "input_length": 10, "output_length": 5}\n', 2, "arrival order"),
    ('{"timestamp": "now", "input_length": 10, "output_length": 5}\n', 1, "timestamp"),
    ('{"timestamp": 0, "output_length": 5}\n', 1, '"input_length"'),
    ('{"timestamp": 0, "input_length": 10, "output_length": 0}\n', 1, '"output_length"'),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": "ab"}\n', 1,
     "hash_ids"),
])
def test_a_malformed_trace_names_the_line(tmp_path: Path, lines: str, line: int,
                                          message: str) -> None:
    _assert_names_the_line(tmp_path, TRACE, "t.jsonl", lines, line, message)


def test_the_shipped_sample_trace_loads() -> None:
    w = workloads.load("trace")
    assert w.dataset == "timed_trace" and w.num_prompts(32) == 48


def test_prompts_go_through_the_chat_template_only_where_the_model_has_one(tmp_path: Path
                                                                             ) -> None:
    from pipeline.bench.client import has_chat_template

    assert not has_chat_template(tmp_path)  # a base model: prompts are sent as they are
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path)


def test_warm_up_before_a_load_points_first_run_only_and_never_before_a_search() -> None:
    chat = workloads.load("chat")
    first, later = chat.client_args(4, 0), chat.client_args(4, 1)
    assert first[first.index("--num-warmups") + 1] == "4" and "--num-warmups" not in later
    search = workloads.load("capacity")  # its start-up wave, sent and not counted, is the batch
    assert "--num-warmups" not in search.client_args(8, 0)
    assert search.num_prompts(8) - search.counted(8) == 8
    rate = workloads.load("capacity-rate")  # an open loop counts every request: warmed
    assert "--num-warmups" in rate.client_args(2, 0)


def test_only_the_headline_load_point_repeats_while_a_speedup_is_undecided(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The decision is made at the headline: it is repeated up to the cap while a variant is
    undecided there; the other load points get their curve_repeats (one run a model)."""
    from pipeline.bench import measure
    from pipeline.core.variant import BASELINE, Variant

    chat = workloads.load("chat")
    other = next(c for c in chat.load_points if c != chat.headline)
    assert chat.looks("cpu", other).last < chat.looks("cpu").last
    assert chat.repeats_at(other) == chat.curve_repeats < chat.repeats  # a run: the curve
    rates = {BASELINE: 100.0, "same": 100.0}  # identical speeds with noise: never decided
    noise = iter([1.0, 1.3, 0.8, 1.2, 0.9] * 40)

    def fake_load_point(client, server, record, step, out):  # the load point's figures
        result = {"output_throughput": rates[record.variant.name] * next(noise)}
        record.runs.setdefault(step.key, {}).setdefault(step.concurrency, []).append(result)
        return result

    monkeypatch.setattr(measure, "_load_point", fake_load_point)
    records = {name: measure.ModelRecord(Variant(name, tmp_path, name)) for name in rates}
    live = {name: object() for name in rates}
    steps = measure.steps_for([chat], caching=False)
    for step in steps:
        measure._run_step(None, live, records, step, tmp_path, None, "", list(live))
    measure._repeat_undecided(None, live, records, steps, tmp_path, None)
    runs = records["same"].runs[chat.name]
    assert len(runs[other]) == chat.curve_repeats  # described, not repeated
    assert len(runs[chat.headline]) == chat.max_repeats  # undecided: up to the cap
    assert len(records[BASELINE].runs[chat.name][chat.headline]) == chat.max_repeats

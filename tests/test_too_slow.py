"""A variant served so slowly that a sweep would take hours is probed, dropped and remembered
like a missing kernel (eval then scores it emulated, the report says "too slow here"); one
that is merely slow is benchmarked as usual."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.measure import PROBE_FLOOR_S, SLOW_FACTOR, ModelRecord, drop_too_slow
from pipeline.core.artifacts import Row
from pipeline.core.variant import BASELINE, Variant
from pipeline.report.render import _speed_cell
from pipeline.serve import ServeError, TooSlow, UnsupportedFormat, is_too_slow, known_refusal
from pipeline.serve.failure import TOO_SLOW


class FakeServer:
    """Answers a probe in ``seconds`` (None: no answer in time; a list: one per probe, the last
    repeated), records each timeout."""

    warmup_timeout = 300.0

    def __init__(self, seconds: float | list[float | None] | None, fails: bool = False) -> None:
        self.answers = seconds if isinstance(seconds, list) else [seconds]
        self.fails = fails
        self.timeouts: list[float] = []
        self.stopped = False
        self.log_path = Path("server.log")
        self.peak_memory_bytes = 0

    def probe(self, timeout: float) -> float | None:
        self.timeouts.append(timeout)
        if self.fails:
            raise ServeError("the connection was reset", reason="probe failed")
        seconds = self.answers[min(len(self.timeouts), len(self.answers)) - 1]
        if seconds is None or seconds > timeout:
            return None
        return seconds

    def stop(self) -> None:
        self.stopped = True


def _setup(servers: dict[str, FakeServer]) -> tuple[dict, dict[str, ModelRecord]]:
    records = {name: ModelRecord(Variant(name, Path(name), f"id-{name}"), engine={
        "kernels": [f"{name.upper()}Kernel for Scheme"]}) for name in servers}
    return dict(servers), records


def test_a_variant_fifty_times_slower_is_dropped_and_remembered(workspace: Path) -> None:
    servers = {BASELINE: FakeServer(0.12), "int8": FakeServer(0.3), "fp8": FakeServer(8.0),
               "odd": FakeServer(None)}
    live, records = _setup(servers)
    drop_too_slow(live, records, pool=None)

    assert set(live) == {BASELINE, "int8"}
    assert records["int8"].status == "ok" and records[BASELINE].status == "ok"
    fp8, odd = records["fp8"], records["odd"]
    assert fp8.status == odd.status == "unsupported"
    assert is_too_slow(fp8.reason) and fp8.reason.startswith(TOO_SLOW)
    assert "gave no answer within 6.0 s, twice (abandoned)" in fp8.reason
    assert "over 50x slower" in fp8.reason and "the baseline's 0.12 s" in fp8.reason
    assert "FP8Kernel for Scheme" in fp8.reason  # what vLLM chose, in its words
    assert servers["fp8"].timeouts == [pytest.approx(6.0)] * 2  # a second chance, then dropped
    assert "gave no answer within 6.0 s, twice" in odd.reason
    assert known_refusal("id-fp8") == fp8.reason  # eval scores it emulated from now on
    assert known_refusal("id-int8") is None
    assert servers["fp8"].stopped and servers["odd"].stopped
    assert not servers["int8"].stopped and not servers[BASELINE].stopped
    assert len(servers[BASELINE].timeouts) == 2  # the baseline's faster of two


def test_the_probe_waits_for_the_bound_or_the_floor_whichever_is_longer(
        workspace: Path) -> None:
    for base, expected in ((0.02, PROBE_FLOOR_S), (0.5, SLOW_FACTOR * 0.5)):
        variant = FakeServer(0.01)
        live, records = _setup({BASELINE: FakeServer(base), "int8": variant})
        drop_too_slow(live, records, pool=None)
        assert variant.timeouts == [pytest.approx(expected)]
        assert "int8" in live and not variant.stopped

def test_a_ratio_of_tiny_timings_or_one_slowed_request_drops_nothing(workspace: Path) -> None:
    """A tiny model's baseline answers in 0.01 s: a variant at 1 s is 100x, yet its sweep ends
    in minutes; and a request slowed past the limit by a busy host is tried again."""
    tiny = FakeServer(1.0)
    busy = FakeServer([None, 0.3])
    live, records = _setup({BASELINE: FakeServer(0.01), "int4": tiny, "int8": busy})
    drop_too_slow(live, records, pool=None)
    assert set(live) == {BASELINE, "int4", "int8"}
    assert records["int4"].status == records["int8"].status == "ok"
    assert tiny.timeouts == [PROBE_FLOOR_S] and busy.timeouts == [PROBE_FLOOR_S] * 2
    # over the floor as well as the ratio: dropped
    slow = FakeServer(6.0)
    live, records = _setup({BASELINE: FakeServer(0.01), "int4": slow})
    drop_too_slow(live, records, pool=None)
    assert "int4" not in live and slow.stopped and "over 500x slower" in records["int4"].reason


def test_a_probe_that_fails_is_a_failure_not_slowness(workspace: Path) -> None:
    live, records = _setup({BASELINE: FakeServer(0.1), "int8": FakeServer(0.1, fails=True)})
    drop_too_slow(live, records, pool=None)
    assert records["int8"].status == "failed" and not is_too_slow(records["int8"].reason)
    assert known_refusal("id-int8") is None  # a failure is never remembered as hardware


def test_nothing_is_probed_without_a_baseline_or_when_it_cannot_answer(
        workspace: Path) -> None:
    variant = FakeServer(100.0)
    live, records = _setup({"fp8": variant})
    drop_too_slow(live, records, pool=None)
    assert variant.timeouts == [] and "fp8" in live
    live, records = _setup({BASELINE: FakeServer(None), "fp8": variant})
    drop_too_slow(live, records, pool=None)
    assert variant.timeouts == [] and "fp8" in live  # the runs will show the baseline's state


def test_the_report_says_too_slow_here_with_the_measured_reason() -> None:
    reason = (f"{TOO_SLOW}: vLLM serves it (X), but one warm request of 4 tokens took 9.0 s "
              "against the baseline's 0.10 s, 90x slower")
    common = {"recipe": "x", "scheme": "x", "precision": "x", "weight_bytes": 1,
              "weight_ratio": 0.5, "serving": "unsupported"}
    row = Row(name="fp8", format="float-quantized", serving_reason=reason, **common)
    assert _speed_cell(row) == "too slow here"
    missing = Row(name="mxfp4", format="mxfp4-pack-quantized",
                  serving_reason="Failed to find a kernel", **common)
    assert _speed_cell(missing) == "unsupported here"
    assert issubclass(TooSlow, UnsupportedFormat)  # bench and eval treat it as a refusal

"""Sub-processes a few at a time: the slot limit, logs, the first failure stops the rest."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pipeline.campaign import jobs
from pipeline.core import procs


def _job(tmp_path: Path, label: str, code: str) -> jobs.Job:
    return jobs.Job(label, [sys.executable, "-c", code], tmp_path / f"{label}.log")


def _interval(marker: Path) -> tuple[float, float]:
    start, end = marker.read_text().split()
    return float(start), float(end)


def test_at_most_slots_run_at_once_and_each_has_its_log(tmp_path: Path) -> None:
    code = ("import sys, time; t = time.time(); print('working'); time.sleep(0.6); "
            "open(sys.argv[1], 'w').write(f'{t} {time.time()}')")
    todo = []
    for i in range(4):
        job = _job(tmp_path, f"job{i}", code)
        job.argv.append(str(tmp_path / f"job{i}.marker"))
        todo.append(job)
    done: list[str] = []
    jobs.run_all(todo, slots=2, on_done=lambda job: done.append(job.label), poll_s=0.05)
    assert sorted(done) == [f"job{i}" for i in range(4)]
    spans = [_interval(tmp_path / f"job{i}.marker") for i in range(4)]
    for moment in (s for s, _ in spans):  # never more than two alive at a start
        assert sum(s <= moment < e for s, e in spans) <= 2
    assert max(s for s, _ in spans[:2]) < min(e for _, e in spans[:2])  # the first two overlap
    assert (tmp_path / "job0.log").read_text().strip() == "working"


def test_the_first_failure_stops_the_others_and_names_the_log(tmp_path: Path) -> None:
    slow = _job(tmp_path, "slow", "import time; time.sleep(60)")
    bad = _job(tmp_path, "bad", "import sys; print('broken input'); sys.exit(3)")
    never = _job(tmp_path, "never", "print('ran')")
    started = time.monotonic()
    with pytest.raises(jobs.JobFailed) as failed:
        jobs.run_all([slow, bad, never], slots=2, poll_s=0.05)
    assert time.monotonic() - started < 30
    assert failed.value.code == 3 and failed.value.job is bad
    assert str(bad.log) in str(failed.value)
    assert "broken input" in bad.tail()
    assert slow.proc is not None and slow.proc.poll() is not None
    assert procs.exited(slow.proc.pid)
    assert never.proc is None  # not started after the failure


def test_heartbeat_reports_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job(tmp_path, "step", "import time; print('(3/7): Calibrating', flush=True); "
                                 "time.sleep(1)")
    jobs.run_all([job], slots=1, progress=lambda j: "layer 3/7" if "(3/7)" in j.tail() else "",
                 heartbeat_s=0.3, poll_s=0.05)
    out = capsys.readouterr().out
    assert "[all] step: started" in out
    assert "[all] running: step (layer 3/7, 0:00)" in out


def test_keep_going_runs_the_others_and_returns_the_failures(tmp_path: Path) -> None:
    todo = [_job(tmp_path, "bad", "import sys; print('boom'); sys.exit(3)"),
            _job(tmp_path, "good", "print('fine')")]
    done: list[str] = []
    failed = jobs.run_all(todo, slots=1, on_done=lambda job: done.append(job.label),
                          poll_s=0.05, keep_going=True)
    assert done == ["good"]
    assert [(f.job.label, f.code) for f in failed] == [("bad", 3)]


def test_a_failed_quantize_is_explained_by_its_last_error_line() -> None:
    from pipeline.campaign.local import last_error

    assert last_error("x\nTraceback\nValueError: bad scheme\n") == "ValueError: bad scheme"
    assert last_error("[quantize] x\nqpipe quantize: recipe broke\n") == \
        "qpipe quantize: recipe broke"
    assert last_error("") == "no output"

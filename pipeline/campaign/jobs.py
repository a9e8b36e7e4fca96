"""Commands run as sub-processes a few at a time, each writing to its own log file.

A line of progress every half minute, the first failure stops the rest, and an interrupt
(Ctrl-C, SIGTERM) stops every running command before it is re-raised: each command cleans up
after itself (its temp directories) on SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core import log as qlog
from pipeline.core import procs
from pipeline.core.errors import QpipeError

log = qlog.get("all")


class JobFailed(QpipeError):
    def __init__(self, job: Job, code: int) -> None:
        super().__init__(f"{job.label} failed (exit {code}); log: {job.log}")
        self.job, self.code = job, code


@dataclass
class Job:
    label: str
    argv: list[str]
    log: Path
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    started: float = 0.0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_bytes(b"")
        self.proc = procs.start(self.argv, log=self.log, cwd=self.cwd, die_with_parent=True)
        self.started = time.monotonic()

    def tail(self, size: int = 8192) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(max(0, f.seek(0, 2) - size))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM (the command removes its temp directories), then SIGKILL after 60 s."""
        procs.stop(self.proc, timeout=60)


def qpipe(*args: str) -> tuple[str, ...]:
    """The argv of ``qpipe ARGS`` with this interpreter (the same venv on every node)."""
    return (sys.executable, "-m", "pipeline.cli", *args)


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


class Steps:
    """The campaign's progress lines: ``[all 3-4/7] bench (elapsed 2:10)``."""

    def __init__(self, total: int) -> None:
        self.started, self.total, self.step = time.monotonic(), total, 0

    def elapsed(self) -> str:
        return clock(time.monotonic() - self.started)

    def next(self, label: str, count: int = 1) -> None:
        first, self.step = self.step + 1, self.step + count
        steps = f"{first}-{self.step}" if count > 1 else f"{first}"
        print(f"\n[all {steps}/{self.total}] {label} (elapsed {self.elapsed()})", flush=True)


def _state(job: Job, now: float, progress: Callable[[Job], str]) -> str:
    parts = [p for p in (progress(job), clock(now - job.started)) if p]
    return f"{job.label} ({', '.join(parts)})"


def run_all(jobs: list[Job], slots: int, on_done: Callable[[Job], None] = lambda job: None,
            progress: Callable[[Job], str] = lambda job: "", heartbeat_s: float = 30,
            poll_s: float = 0.5, keep_going: bool = False) -> list[JobFailed]:
    """Run ``jobs`` with at most ``slots`` at once, in order. Raises JobFailed on the first
    non-zero exit (after stopping the others); with ``keep_going`` the others run on and the
    failures are returned instead."""
    waiting, running = list(jobs), []
    failures: list[JobFailed] = []
    last_beat = time.monotonic()
    try:
        while waiting or running:
            while waiting and len(running) < max(1, slots):
                job = waiting.pop(0)
                job.start()
                running.append(job)
                log.info(f"{job.label}: started (log {job.log})")
            time.sleep(poll_s)
            for job in list(running):
                assert job.proc is not None
                code = job.proc.poll()
                if code is None:
                    continue
                running.remove(job)
                if code != 0:
                    if not keep_going:
                        raise JobFailed(job, code)
                    failures.append(JobFailed(job, code))
                    continue
                on_done(job)
            if running and time.monotonic() - last_beat >= heartbeat_s:
                last_beat = time.monotonic()
                states = [_state(job, last_beat, progress) for job in running]
                if waiting:
                    states.append(f"{len(waiting)} waiting")
                log.info(f"running: {'; '.join(states)}")
    finally:
        for job in running:
            job.stop()
    return failures

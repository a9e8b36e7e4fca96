"""Processes qpipe starts: each in its own process group, stopped as a group, nothing left.

vLLM servers, the benchmark client, quantize jobs and the MLflow UI all start through
:func:`start` and stop through :func:`stop`: SIGTERM to the group, SIGKILL to what is left after
a timeout, then any child that left the group. With ``die_with_parent`` the kernel sends the
child SIGTERM if qpipe itself dies (PR_SET_PDEATHSIG), so no server outlives a run.

A process listed (a group, a family, every process) may exit before the next call on it: the
functions here that ask the OS about listed processes (:func:`family`, :func:`group`,
:func:`command_line`, :func:`exited`) treat a process that is gone as not there, never as an
error. Tests and stages ask through them (``tests/test_procs.py`` checks that nothing else
calls the OS on a listed process unguarded).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

PR_SET_PDEATHSIG = 1


def _own_group(die_with_parent: bool) -> Any:
    def setup() -> None:  # in the child, before exec
        os.setsid()
        if die_with_parent:
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return setup


def start(argv: Sequence[str], *, log: Path | None = None, env: Mapping[str, str] | None = None,
          cwd: Path | None = None, die_with_parent: bool = False,
          stdin: int | IO[Any] | None = None, stdout: int | IO[Any] | None = None,
          text: bool = False) -> subprocess.Popen[Any]:
    """Start ``argv`` in a new session; its output goes to ``log`` (appended) unless piped."""
    out: IO[Any] | int | None = stdout
    handle = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = log.open("ab")
        out = stdout if stdout is not None else handle
    try:
        return subprocess.Popen(list(argv), stdin=stdin, stdout=out,
                                stderr=handle if handle is not None else None,
                                env=dict(env) if env is not None else None, cwd=cwd, text=text,
                                preexec_fn=_own_group(die_with_parent))
    finally:
        if handle is not None:
            handle.close()


def family(proc: subprocess.Popen[Any] | int) -> list[psutil.Process]:
    """The process (a ``Popen`` or a pid) and every process it started; [] once it is gone."""
    try:
        root = psutil.Process(proc if isinstance(proc, int) else proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid`` (zombies are not live: they hold no
    resource but their pid); one that exits while it is being listed is not in it."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def command_line(proc: psutil.Process) -> str:
    """The process's command line joined by spaces; "" once it is gone (or not ours to read)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (exited, not yet reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def terminate(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM the group without waiting: several can then shut down at once (:func:`stop`
    waits for each)."""
    if proc is not None and (proc.poll() is None or family(proc)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)


def stop(proc: subprocess.Popen[Any] | None, timeout: float = 30) -> None:
    """SIGTERM the group, SIGKILL whatever is left after ``timeout``; reap every child."""
    if proc is None:
        return
    members = family(proc)
    if proc.poll() is None or members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # a member that ignored SIGTERM
    _, alive = psutil.wait_procs(members, timeout=10)
    for p in alive:  # a child that left the group
        with contextlib.suppress(psutil.Error):
            p.kill()

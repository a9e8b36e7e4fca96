"""Write-then-rename helpers: nothing half-written is ever left where a reader looks."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.core import interrupts
from pipeline.core.errors import OutputError

TEMP_PREFIX = ".tmp-"


def output_error(location: Path, err: OSError) -> OutputError:
    """One paragraph for an unwritable or full output location."""
    why = "the disk is full" if err.errno == errno.ENOSPC else (err.strerror or str(err))
    return OutputError(
        f"cannot write to {location} ({why}); nothing was left half-written there. "
        "Set ARTIFACTS= (CLI: the QPIPE_ARTIFACTS environment variable) to a writable "
        "directory with enough free space, or free some space."
    )


def check_free_space(where: Path, needed: int, what: str) -> None:
    """Stop before writing ``what`` if the file system holding ``where`` lacks ``needed``."""
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise OutputError(
            f"{probe} has {free / 1e9:.2f} GB free, and {what} needs up to {needed / 1e9:.2f} GB "
            "while it is written. Free some space or set ARTIFACTS= to a location with more."
        )


def is_disk_full(err: BaseException) -> bool:
    """An OSError with ENOSPC, or a library's own error that says the same (safetensors)."""
    return (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        "No space left on device" in str(err) or "os error 28" in str(err))


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temp dir beside ``target``; rename it to ``target`` only if the block succeeds.

    On any exception (an interrupt included) the temp dir is removed. An existing ``target``
    is replaced only after the new one is complete.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{target.name}-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the finished directory is a normal one
    except OSError as err:
        raise output_error(target.parent, err) from None
    try:
        yield tmp
        interrupts.check()  # never publish the output of a run the user asked to stop
        old = None
        if target.exists():
            old = target.with_name(f"{TEMP_PREFIX}old-{target.name}-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            raise output_error(target.parent, err) from None
        raise
    except Exception as err:  # e.g. safetensors' own error for a full disk
        interrupts.check()
        if is_disk_full(err):
            raise output_error(target.parent, OSError(errno.ENOSPC, "no space left")) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temp_dirs(target: Path) -> list[Path]:
    """Remove the temp dirs that a killed run (SIGKILL, power loss) left for ``target`` (only
    its own: another target beside it may be being written now)."""
    removed = []
    if target.parent.is_dir():
        for pattern in (f"{TEMP_PREFIX}{target.name}-*", f"{TEMP_PREFIX}old-{target.name}-*"):
            for p in target.parent.glob(pattern):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


@contextlib.contextmanager
def exclusive(lock: Path, waiting: str = "") -> Iterator[None]:
    """Hold the lock file ``lock`` while the block runs: one process at a time makes what it
    guards; another waits (saying ``waiting`` once), then finds it made."""
    import fcntl

    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = lock.open("a")
    except OSError as err:
        raise output_error(lock.parent, err) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_json(path: Path) -> dict:
    """A JSON file's object, or {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temp file in the same directory, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

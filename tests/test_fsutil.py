from __future__ import annotations

import errno
from pathlib import Path

import pytest

from pipeline.core.errors import OutputError
from pipeline.core.fsutil import atomic_dir, remove_stale_temp_dirs


def test_atomic_dir_appears_only_when_complete(tmp_path: Path) -> None:
    target = tmp_path / "out" / "variant"
    with atomic_dir(target) as tmp:
        (tmp / "file").write_text("x")
        assert not target.exists()
    assert (target / "file").read_text() == "x"
    assert [p.name for p in target.parent.iterdir()] == ["variant"]


def test_failure_or_interrupt_leaves_nothing_and_keeps_the_old_target(tmp_path: Path) -> None:
    target = tmp_path / "variant"
    with atomic_dir(target) as tmp:
        (tmp / "old").write_text("complete")
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)), atomic_dir(target) as tmp:
            (tmp / "half").write_text("half-written")
            raise exc
        assert sorted(p.name for p in tmp_path.iterdir()) == ["variant"]
        assert (target / "old").read_text() == "complete"


def test_full_disk_becomes_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(OutputError) as err, atomic_dir(tmp_path / "variant"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert "disk is full" in str(err.value) and "ARTIFACTS=" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_location_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OutputError) as err, atomic_dir(blocker / "variant"):
        pass
    assert str(blocker) in str(err.value) and "ARTIFACTS=" in str(err.value)


def test_stale_temp_dirs_of_killed_runs_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".tmp-int4-abc").mkdir()
    (tmp_path / ".tmp-old-int4-12").mkdir()
    (tmp_path / ".tmp-int8-def").mkdir()  # another variant's, being written now: kept
    (tmp_path / "int4").mkdir()
    assert sorted(p.name for p in remove_stale_temp_dirs(tmp_path / "int4")) == [
        ".tmp-int4-abc", ".tmp-old-int4-12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-int8-def", "int4"]


def test_one_process_at_a_time_makes_a_target(tmp_path: Path) -> None:
    """A second holder waits until the first is done (then finds its work made)."""
    import threading
    import time

    from pipeline.core.fsutil import exclusive

    order = []

    def second() -> None:
        with exclusive(tmp_path / "int8.lock", waiting="waiting"):
            order.append("second")

    with exclusive(tmp_path / "int8.lock"):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        order.append("first done")
    thread.join(timeout=10)
    assert order == ["first done", "second"]
    with exclusive(tmp_path / "int4.lock"):  # another lock file is another lock
        pass


def test_a_library_error_for_a_full_disk_becomes_the_same_clear_error(tmp_path: Path) -> None:
    """safetensors raises its own error type, not OSError, when the disk fills."""
    from safetensors import SafetensorError

    with pytest.raises(OutputError) as err, atomic_dir(tmp_path / "baseline"):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                              'StorageFull, message: "No space left on device" })')
    assert "disk is full" in str(err.value) and str(tmp_path) in str(err.value)
    assert list(tmp_path.iterdir()) == []

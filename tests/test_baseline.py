"""Resolving the baseline: a disk too small for the embedded conversion is a sentence."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from pipeline.core import paths
from pipeline.core.errors import OutputError
from pipeline.quantize import baseline as baselines


def test_too_little_space_for_the_embedded_conversion_stops_before_writing(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9, 10**6))
    with pytest.raises(OutputError) as err:
        baselines.resolve("embedded")
    assert "GB free" in str(err.value) and "the bf16 baseline" in str(err.value)
    assert "ARTIFACTS=" in str(err.value)
    assert not paths.baselines_dir().exists() or not list(paths.baselines_dir().iterdir())

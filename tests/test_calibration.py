"""Calibration data: what the data caps is said, never silently applied."""

from __future__ import annotations

import dataclasses

from pipeline.quantize import calibration, recipes


def test_a_request_beyond_the_data_is_said() -> None:
    calib = recipes.load("int4").calibration
    assert calib is not None
    big = dataclasses.replace(calib, num_samples=512, max_seq_length=2048)
    notes = calibration.caps(big, rows=274, longest_tokens=600)
    assert len(notes) == 2
    assert "274 samples, fewer than the 512 asked (CALIB_SAMPLES)" in notes[0]
    assert "CALIB_DATA=" in notes[0]
    assert "longest sample is 600 tokens, shorter than the 2048 asked" in notes[1]
    assert calibration.caps(calib, rows=274, longest_tokens=600) == []

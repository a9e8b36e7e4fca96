"""Regenerate recipes/calibration/python-reference.jsonl (run once; the output is committed).

Source: the Python Language Reference topics that CPython ships as ``pydoc_data.topics``
(PSF License 2.0). English prose with code, no overlap with the evaluation suites in evals/.
Each record is ~2,000 characters (~500 tokens), cut at paragraph boundaries.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from pydoc_data.topics import topics

TARGET_CHARS = 2000
OUT = Path(__file__).resolve().parent.parent / "recipes" / "calibration" / "python-reference.jsonl"


def chunks(text: str) -> list[str]:
    out, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) > TARGET_CHARS:
            out.append(current.strip())
            current = ""
        current += para + "\n\n"
    if len(current.strip()) > TARGET_CHARS // 4:
        out.append(current.strip())
    return out


def main() -> None:
    records = [
        {"text": chunk, "source": f"pydoc_data.topics:{name}"}
        for name in sorted(topics)
        for chunk in chunks(topics[name])
    ]
    with OUT.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    print(f"{len(records)} records from Python {sys.version.split()[0]} -> {OUT}")


if __name__ == "__main__":
    main()

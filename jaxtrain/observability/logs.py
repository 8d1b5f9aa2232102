"""The run's metric log: one JSON object per line in <output_dir>/metrics.jsonl.

Written by process 0 only; every record has "step" and "time" so the file alone is enough
to plot a run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class JsonlLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def write(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time()}
        for key, value in values.items():
            # JSON has no NaN/Inf: keep the information as a string instead of dropping it.
            if isinstance(value, float) and not math.isfinite(value):
                value = str(value)
            record[key] = value
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


class NullLog:
    """The metric log of processes other than 0: writes nothing."""

    def write(self, step: int, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

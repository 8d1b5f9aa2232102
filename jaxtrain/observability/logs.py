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

from jaxtrain.errors import ArgumentError


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
    """The records of a metric log. A last line cut short (a crash or a full disk mid-write:
    the resumed run drops it too) is left out; a bad line before it is an error naming it."""
    with Path(path).open() as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if n == lines[-1][0]:
                break
            raise ArgumentError(
                f"{path} line {n} is not JSON ({err.msg}, column {err.colno}); fix or remove it"
            ) from None
    return records


class NullLog:
    """The metric log of processes other than 0: writes nothing."""

    def write(self, step: int, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

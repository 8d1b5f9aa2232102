"""Minimal safetensors reader/writer on numpy memory maps (bf16 via ml_dtypes).

Format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the tensor bytes (offsets relative to the end of the header). Reading maps the file, so a
tensor's bytes are touched only when it is used; nothing depends on torch. A loader that has
copied a tensor releases its pages (`release`): read pages of a mapped file count in the
process's resident memory until it is unmapped, and a QLoRA load's peak would hold the whole
float checkpoint besides the quantized model.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxtrain.hf.errors import HFError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one .safetensors file: ``names``, ``shape(name)``, ``get(name)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, ValueError) as err:
            raise HFError(f"{self.path}: not a readable safetensors file ({err}).") from err
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict[str, Any]] = header
        self._start = 8 + length
        self._file: mmap.mmap | None = None
        self._map: np.ndarray | None = None  # the whole file as bytes, over `_file`

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array backed by the file mapping."""
        entry = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise HFError(
                f"{self.path}: tensor {name!r} has dtype {entry['dtype']}, which jaxtrain "
                f"cannot read; supported: {', '.join(DTYPES)}."
            )
        if self._map is None:
            with open(self.path, "rb") as f:
                self._file = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._map = np.frombuffer(self._file, dtype=np.uint8)
        begin, end = entry["data_offsets"]
        raw = self._map[self._start + begin : self._start + end]
        return raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def release(self, name: str) -> None:
        """Drop the pages of `name`'s bytes from this process's memory (the page cache keeps
        them): the caller has copied the tensor. A later `get` reads them again."""
        if self._file is None or not hasattr(mmap, "MADV_DONTNEED"):  # Windows has no madvise
            return
        begin, end = self._entries[name]["data_offsets"]
        first = (self._start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        self._file.madvise(mmap.MADV_DONTNEED, first, self._start + end - first)


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` (name -> C-contiguous numpy array) to ``path``."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES:
            raise HFError(f"cannot write tensor {name!r} of dtype {array.dtype} to safetensors.")
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in arrays:
            f.write(array.tobytes())

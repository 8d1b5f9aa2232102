"""Pack several documents into one fixed-length row, keeping them independent.

A packed row carries, besides ``input_ids``/``labels``/``attention_mask``:

- ``segment_ids``: 1, 2, ... per document, 0 on padding. The model's attention lets a token
  see only earlier tokens with the same segment id (``layers.causal_attention``).
- ``positions``: 0, 1, ... restarting at every document, so rotary embeddings see each
  document exactly as if it sat alone at the start of a row.

The label of each document's first token is -100: the loss predicts ``labels[t + 1]`` from
position t, and the last token of one document must not learn to predict the next document.
Together this makes the per-token loss of a packed document equal its loss alone in a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, CollateStats

__all__ = ["PACKED_FIELDS", "doc_tokens", "pack_row"]

PACKED_FIELDS = ("input_ids", "attention_mask", "labels", "segment_ids", "positions")


def doc_tokens(
    example: dict[str, Any], *, seq_len: int, truncation_mode: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(input_ids, labels, number of tokens cut) of one example, at most ``seq_len`` long."""
    ids = np.asarray(example["input_ids"], np.int64)
    labels = example.get("labels")
    labels = ids.copy() if labels is None else np.asarray(labels, np.int64).copy()
    mask = example.get("attention_mask")
    if mask is not None:
        labels[np.asarray(mask) == 0] = IGNORE_INDEX
    cut = max(len(ids) - seq_len, 0)
    if cut:
        keep = slice(0, seq_len) if truncation_mode == "keep_start" else slice(cut, None)
        ids, labels = ids[keep], labels[keep]
    return ids, labels, cut


def pack_row(
    docs: Sequence[tuple[np.ndarray, np.ndarray]], *, seq_len: int, pad_token_id: int
) -> tuple[dict[str, np.ndarray], CollateStats]:
    """One row from already-truncated (input_ids, labels) documents whose lengths fit."""
    total = sum(len(ids) for ids, _ in docs)
    if total > seq_len:
        raise ValueError(f"documents of {total} tokens do not fit a row of {seq_len}")
    row = {
        "input_ids": np.full(seq_len, pad_token_id, np.int32),
        "attention_mask": np.zeros(seq_len, np.int32),
        "labels": np.full(seq_len, IGNORE_INDEX, np.int32),
        "segment_ids": np.zeros(seq_len, np.int32),
        "positions": np.zeros(seq_len, np.int32),
    }
    at = 0
    for segment, (ids, labels) in enumerate(docs, start=1):
        n = len(ids)
        if n == 0:
            continue
        row["input_ids"][at : at + n] = ids
        row["attention_mask"][at : at + n] = 1
        row["labels"][at : at + n] = labels
        row["labels"][at] = IGNORE_INDEX  # never predicted from the previous document
        row["segment_ids"][at : at + n] = segment
        row["positions"][at : at + n] = np.arange(n)
        at += n
    return row, CollateStats(0, seq_len - at)


class Packer:
    """Greedy packing of a ``(position, example)`` stream into rows, one row at a time.

    A document that does not fit the rest of a row starts the next row, so the position
    after a row is simply the position of the first document not yet packed.
    """

    def __init__(self, units: Any, *, seq_len: int, pad_token_id: int, truncation_mode: str):
        self._units = iter(units)
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self.truncation_mode = truncation_mode
        self._pending: tuple[Any, tuple[np.ndarray, np.ndarray]] | None = None
        self._pending_cut = 0

    def _peek(self) -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
        if self._pending is None:
            position, example = next(self._units)
            ids, labels, cut = doc_tokens(
                example, seq_len=self.seq_len, truncation_mode=self.truncation_mode
            )
            self._pending, self._pending_cut = (position, (ids, labels)), cut
        return self._pending

    def position(self) -> Any:
        """Position of the next document to pack."""
        return self._peek()[0]

    def next_row(self) -> tuple[dict[str, np.ndarray], CollateStats]:
        docs: list[tuple[np.ndarray, np.ndarray]] = []
        used = truncated = 0
        while True:
            _, doc = self._peek()
            if docs and used + len(doc[0]) > self.seq_len:
                break
            docs.append(doc)
            used += len(doc[0])
            truncated += self._pending_cut
            self._pending = None
            if used >= self.seq_len:
                break
        row, stats = pack_row(docs, seq_len=self.seq_len, pad_token_id=self.pad_token_id)
        return row, CollateStats(truncated, stats.num_padding_tokens)

"""Pack several documents into fixed-length rows, keeping them independent.

A packed row carries, besides ``input_ids``/``labels``/``attention_mask``:

- ``segment_ids``: 1, 2, ... per document, 0 on padding. The model's attention lets a token
  see only earlier tokens with the same segment id (``models.attention.causal_attention``).
- ``positions``: 0, 1, ... restarting at every document, so rotary embeddings see each
  document exactly as if it sat alone at the start of a row.

The label of each document's first token is -100: the loss predicts ``labels[t + 1]`` from
position t, and the last token of one document must not learn to predict the next document.
Together this makes the per-token loss of a packed document equal its loss alone in a row.

``Packer`` packs a stream in blocks: it reads up to ``window`` documents of one epoch, splits
(or truncates) the over-long ones, places them with best-fit decreasing (longest first, each
into the fullest row that still has room) and hands the rows out in an order shuffled by
``(seed, epoch, offset of the block)``. The rows are a pure function of the block's documents
and the seed, so the position ``(epoch, offset of the block, rows already handed out)`` is all
a resume needs: re-read that block, re-pack it, skip the rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, CollateStats, tokens_cut

__all__ = [
    "PACKED_FIELDS",
    "ImageSlots",
    "Packer",
    "best_fit_decreasing",
    "doc_tokens",
    "pack_row",
    "split_document",
]

PACKED_FIELDS = ("input_ids", "attention_mask", "labels", "segment_ids", "positions")
Doc = tuple[np.ndarray, np.ndarray]  # (input_ids, labels)
PackPosition = tuple[int, int, int]  # (epoch, offset of the block's first document, row)


def doc_tokens(
    example: dict[str, Any], *, seq_len: int, truncation_mode: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(input_ids, labels, number of tokens cut) of one example, at most ``seq_len`` long."""
    ids, labels = _ids_labels(example)
    cut = max(len(ids) - seq_len, 0)
    if cut:
        keep = slice(0, seq_len) if truncation_mode == "keep_start" else slice(cut, None)
        ids, labels = ids[keep], labels[keep]
    return ids, labels, cut


def _ids_labels(example: dict[str, Any]) -> Doc:
    ids = np.asarray(example["input_ids"], np.int64)
    labels = example.get("labels")
    labels = ids.copy() if labels is None else np.asarray(labels, np.int64).copy()
    mask = example.get("attention_mask")
    if mask is not None:
        labels[np.asarray(mask) == 0] = IGNORE_INDEX
    return ids, labels


def split_document(ids: np.ndarray, labels: np.ndarray, seq_len: int) -> list[Doc]:
    """Row-sized pieces of one document, each packed as a document of its own.

    Consecutive pieces overlap by one token: a piece's first token is never a target (it has
    no context in its row), so repeating the previous piece's last token as its first keeps
    every token of the document a target exactly once, as if the row were endless.
    """
    if len(ids) <= seq_len:
        return [(ids, labels)]
    if seq_len < 2:
        raise ValueError(f"splitting documents needs max_sequence_length >= 2, got {seq_len}")
    stride = seq_len - 1
    return [
        (ids[start : start + seq_len], labels[start : start + seq_len])
        for start in range(0, len(ids) - 1, stride)
    ]


def best_fit_decreasing(
    lengths: Sequence[int],
    capacity: int,
    images: Sequence[int] | None = None,
    image_capacity: int = 0,
) -> list[list[int]]:
    """Bins (lists of item indices) of at most ``capacity``: longest item first, each into
    the bin with the least room left that still fits it (ties: the earlier bin). With
    ``images`` (each item's image count) a bin also holds at most ``image_capacity`` images."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    held: list[int] = []  # images per bin
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        n, k = lengths[i], (images[i] if images is not None else 0)
        if n > capacity or (images is not None and k > image_capacity):
            raise ValueError(f"item {i} of length {n} exceeds the capacity {capacity}")
        at = bisect.bisect_left(free, (n, -1))
        while at < len(free) and held[free[at][1]] + k > image_capacity:
            at += 1  # fits the tokens, not the images: the next fullest
        if at == len(free):
            bins.append([i])
            held.append(k)
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            held[b] += k
            room -= n
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


@dataclass(frozen=True)
class ImageSlots:
    """The image slots of each batch row (data/vision.py): ``per_row`` images of ``shape``
    (C, H, W), a row's images first in their tokens' order, the rest zero."""

    per_row: int
    shape: tuple[int, ...]

    def row(self, images: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros((self.per_row, *self.shape), np.float32)
        at = 0
        for group in images:
            out[at : at + len(group)] = group
            at += len(group)
        return out


def pack_row(
    docs: Sequence[Doc], *, seq_len: int, pad_token_id: int
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
    segment = 0
    for ids, labels in docs:
        n = len(ids)
        if n == 0:
            continue
        segment += 1
        row["input_ids"][at : at + n] = ids
        row["attention_mask"][at : at + n] = 1
        row["labels"][at : at + n] = labels
        row["labels"][at] = IGNORE_INDEX  # never predicted from the previous document
        row["segment_ids"][at : at + n] = segment
        row["positions"][at : at + n] = np.arange(n)
        at += n
    return row, CollateStats(0, seq_len - at)


class _Block:
    """The packed rows of one block of documents, in hand-out order."""

    def __init__(self, epoch: int, offset: int, rows: list[tuple[list[int], int]], docs, images):
        self.epoch, self.offset, self.rows = epoch, offset, rows  # rows: (doc indices, cut)
        self.docs, self.images = docs, images  # the block's documents and their images
        self.next = 0


class Packer:
    """Best-fit-decreasing packing of a ``(position, example)`` stream over bounded blocks.

    ``units`` yields ``((epoch, offset), example)`` in stream order and must start at the
    block start of ``skip_rows`` (the position ``(epoch, offset, row)`` that ``position()``
    returned). ``split_long=True`` cuts a document longer than a row into row-sized pieces
    (``split_document``); ``False`` truncates it by ``truncation_mode`` and counts the cut.
    """

    def __init__(
        self,
        units: Any,
        *,
        seq_len: int,
        pad_token_id: int,
        truncation_mode: str = "keep_end",
        split_long: bool = True,
        window: int = 1024,
        seed: int = 0,
        shuffle: bool = True,
        skip_rows: int = 0,
        image_slots: ImageSlots | None = None,
    ):
        if window < 1:
            raise ValueError(f"packing_window must be >= 1, got {window}")
        self._units: Iterator[Any] = iter(units)
        self._ahead: Any = None
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self.truncation_mode, self.split_long = truncation_mode, split_long
        self.window, self.seed, self.shuffle = window, seed, shuffle
        self._block: _Block | None = None
        self._skip = skip_rows
        self.image_slots = image_slots  # rows with images: each row's images, its slots

    def _peek(self) -> Any:
        """The next ``(position, example)``, or None at the end of a finite stream."""
        if self._ahead is None:
            self._ahead = next(self._units, None)
        return self._ahead

    def _take(self) -> Any:
        item, self._ahead = self._peek(), None
        return item

    def _read_block(self) -> _Block:
        """Up to ``window`` documents of one epoch (a block never straddles two epochs)."""
        if self._peek() is None:
            raise StopIteration
        (epoch, offset), _ = self._peek()
        docs: list[Doc] = []
        cuts: list[int] = []
        images: list[np.ndarray | None] = []  # each document's (data/vision.py fits its row)
        for _ in range(self.window):
            ahead = self._peek()
            if ahead is None or ahead[0][0] != epoch:
                break
            _, example = self._take()
            cut_before = tokens_cut([example])  # by its featurizer
            if self.split_long and "pixel_values" not in example:
                pieces = split_document(*_ids_labels(example), self.seq_len)
                docs += pieces
                cuts += [cut_before] + [0] * (len(pieces) - 1)
                images += [None] * len(pieces)
            else:
                ids, labels, cut = doc_tokens(
                    example, seq_len=self.seq_len, truncation_mode=self.truncation_mode
                )
                docs.append((ids, labels))
                cuts.append(cut_before + cut)
                images.append(example.get("pixel_values"))
        keep = [i for i, (ids, _) in enumerate(docs) if len(ids)]
        counts = None
        if self.image_slots is not None:
            counts = [0 if images[i] is None else len(images[i]) for i in keep]
        slots = self.image_slots.per_row if self.image_slots is not None else 0
        bins = best_fit_decreasing([len(docs[i][0]) for i in keep], self.seq_len, counts, slots)
        rows = [([keep[j] for j in b], sum(cuts[keep[j]] for j in b)) for b in bins]
        if not rows:  # a block of empty documents still yields a row: the stream moves on
            rows = [([], 0)]
        if self.shuffle:
            # Best-fit puts the long documents first; mix the rows so batches look alike.
            perm = np.random.default_rng([self.seed, epoch, offset]).permutation(len(rows))
            rows = [rows[int(i)] for i in perm]
        return _Block(epoch, offset, rows, docs, images)

    def _current(self) -> _Block:
        if self._block is None or self._block.next >= len(self._block.rows):
            self._block = self._read_block()
            self._block.next, self._skip = min(self._skip, len(self._block.rows)), 0
            if self._block.next >= len(self._block.rows):
                return self._current()
        return self._block

    def position(self) -> PackPosition:
        """Where the next row comes from: (epoch, offset of its block, rows before it)."""
        block = self._current()
        return block.epoch, block.offset, block.next

    def next_row(self) -> tuple[dict[str, np.ndarray], CollateStats]:
        block = self._current()
        indices, cut = block.rows[block.next]
        block.next += 1
        self.last_epoch = block.epoch
        docs = [block.docs[i] for i in indices]
        row, stats = pack_row(docs, seq_len=self.seq_len, pad_token_id=self.pad_token_id)
        if self.image_slots is not None:
            mine = [block.images[i] for i in indices if block.images[i] is not None]
            row["pixel_values"] = self.image_slots.row(mine)
        return row, CollateStats(cut, stats.num_padding_tokens)

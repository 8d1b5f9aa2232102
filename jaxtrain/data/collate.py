"""Pad/truncate tokenized examples into fixed-shape int32 batches (HF causal-LM convention).

``labels`` stay aligned with ``input_ids`` (the loss shifts internally) and are -100 wherever
nothing should be learned: padding, masked positions, and wherever the example said -100.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np

from jaxtrain.config.tables import TRUNCATION_MODES
from jaxtrain.data.errors import DatasetError

__all__ = [
    "IGNORE_INDEX",
    "TRUNCATED_TOKENS",
    "bad_label_error",
    "bad_labels",
    "TRUNCATION_MODES",
    "CollateStats",
    "collate_examples",
    "masked_positions",
    "tokens_cut",
]

IGNORE_INDEX = -100


def bad_labels(labels: np.ndarray, vocab_size: int | None) -> np.ndarray:
    """Where `labels` are neither IGNORE_INDEX nor a token id of the vocabulary: a -1 would
    gather the last token's log-probability and an id past the vocabulary a NaN loss."""
    bad = (labels != IGNORE_INDEX) & (labels < 0)
    if vocab_size is not None:
        bad |= labels >= vocab_size
    return bad


def bad_label_error(name: str, row: Any, label: int, vocab_size: int | None) -> DatasetError:
    return DatasetError(
        f"{name} row {row}: column 'labels' holds {label}, but a label is {IGNORE_INDEX} "
        f"(ignored) or a token id in [0, vocab_size={vocab_size}); mark the positions to ignore "
        f"with {IGNORE_INDEX}"
    )


# An example's key for its tokens that truncation cuts outside `collate_examples` (a featurizer
# that encodes a prompt + response to fit, a task collator that cuts): counted as truncated.
TRUNCATED_TOKENS = "num_truncated_tokens"


@dataclass(frozen=True)
class CollateStats:
    """Counts that describe a batch but must not be fed to the model.

    num_truncated_tokens: tokens cut off because an example was longer than ``seq_len``, or
      elsewhere (an example's ``TRUNCATED_TOKENS``).
    num_padding_tokens: positions filled with ``pad_token_id`` by the collator (right padding);
      positions an example itself masked with ``attention_mask == 0`` are not counted.
    """

    num_truncated_tokens: int = 0
    num_padding_tokens: int = 0

    def __add__(self, other: CollateStats) -> CollateStats:
        return CollateStats(
            self.num_truncated_tokens + other.num_truncated_tokens,
            self.num_padding_tokens + other.num_padding_tokens,
        )


def tokens_cut(examples: Sequence[Mapping[str, Any]]) -> int:
    """Tokens of these examples that truncation cuts outside `collate_examples`."""
    return sum(int(e.get(TRUNCATED_TOKENS, 0)) for e in examples)


def masked_positions(batch: Mapping[str, np.ndarray]) -> int:
    """Positions of every ``*attention_mask`` array of a batch that hold no token: the padding
    of a task collator's right-padded sides."""
    masks = [np.asarray(v) for k, v in batch.items() if k.endswith("attention_mask")]
    return sum(int(m.size - np.count_nonzero(m)) for m in masks)


def _as_1d_ints(value: Any, *, field: str, index: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(
            f"example {index}: {field!r} must be a 1-D sequence of ints, got "
            f"{type(value).__name__} with shape {arr.shape} and dtype {arr.dtype}; "
            "tokenize the text first (or pass a tokenizer to the loader)"
        )
    return arr.astype(np.int64)


def _check_mode(truncation_mode: str) -> None:
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode={truncation_mode!r} is not supported; use one of {TRUNCATION_MODES}"
        )


@overload
def collate_examples(
    examples: Sequence[Mapping[str, Any]],
    *,
    seq_len: int,
    pad_token_id: int,
    truncation_mode: str = ...,
    return_stats: Literal[False] = ...,
) -> dict[str, np.ndarray]: ...


@overload
def collate_examples(
    examples: Sequence[Mapping[str, Any]],
    *,
    seq_len: int,
    pad_token_id: int,
    truncation_mode: str = ...,
    return_stats: Literal[True],
) -> tuple[dict[str, np.ndarray], CollateStats]: ...


def collate_examples(
    examples: Sequence[Mapping[str, Any]],
    *,
    seq_len: int,
    pad_token_id: int,
    truncation_mode: str = "keep_end",
    return_stats: bool = False,
) -> dict[str, np.ndarray] | tuple[dict[str, np.ndarray], CollateStats]:
    """Collate examples with ``input_ids`` (and optional ``labels``/``attention_mask``).

    Returns int32 ``input_ids``, ``attention_mask`` and ``labels``, each ``[N, seq_len]``,
    right-padded. Longer examples are truncated: ``"keep_start"`` keeps the first ``seq_len``
    tokens, ``"keep_end"`` the last ``seq_len`` (all three fields cut the same way).
    With ``return_stats=True`` returns ``(batch, CollateStats)`` so the counts stay out of the
    dict that goes to the model.
    """
    _check_mode(truncation_mode)
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    n = len(examples)
    input_ids = np.full((n, seq_len), pad_token_id, dtype=np.int32)
    attention_mask = np.zeros((n, seq_len), dtype=np.int32)
    labels = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int32)
    truncated, padded = tokens_cut(examples), 0

    for i, example in enumerate(examples):
        if "input_ids" not in example:
            raise ValueError(
                f"example {i} has no 'input_ids' (keys: {sorted(example)}); tokenize it first"
            )
        ids = _as_1d_ints(example["input_ids"], field="input_ids", index=i)
        length = len(ids)
        fields = {"input_ids": ids}
        for name in ("attention_mask", "labels"):
            if example.get(name) is not None:
                fields[name] = _as_1d_ints(example[name], field=name, index=i)
                if len(fields[name]) != length:
                    raise ValueError(
                        f"example {i}: {name!r} has length {len(fields[name])} but 'input_ids' "
                        f"has length {length}; they must be aligned token by token"
                    )
        if "attention_mask" in fields:
            mask = (fields["attention_mask"] != 0).astype(np.int64)  # any nonzero = real token
        else:
            mask = np.ones(length, np.int64)
        # Labels default to the inputs (causal LM); masked positions are never targets.
        lab = fields.get("labels", ids).copy()
        lab[mask == 0] = IGNORE_INDEX

        if length > seq_len:
            truncated += length - seq_len
            cut = slice(0, seq_len) if truncation_mode == "keep_start" else slice(-seq_len, None)
            ids, mask, lab = ids[cut], mask[cut], lab[cut]
            length = seq_len
        padded += seq_len - length
        input_ids[i, :length] = ids
        attention_mask[i, :length] = mask
        labels[i, :length] = lab

    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    if return_stats:
        return batch, CollateStats(truncated, padded)
    return batch

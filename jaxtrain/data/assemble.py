"""Examples -> one fixed-shape batch: default pad/truncate collation or a user collator.

Filler rows (``fill`` mask) complete a short batch so shapes never change: all-pad rows with
labels -100 and attention_mask 0, which carry no loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.data.collate import (
    IGNORE_INDEX,
    TRUNCATED_TOKENS,
    TRUNCATION_MODES,
    CollateStats,
    collate_examples,
    tokens_cut,
)
from jaxtrain.data.errors import DatasetError

__all__ = ["Batch", "Collation", "Collator"]

Batch = dict[str, np.ndarray]
Collator = Callable[[list[dict[str, Any]]], Mapping[str, Any]]


class Collation:
    """How examples become a batch; validated on construction."""

    def __init__(
        self,
        *,
        name: str,
        seq_len: int,
        pad_token_id: int | None,
        truncation_mode: str = "keep_end",
        collator: Collator | None = None,
    ) -> None:
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(
                f"truncation_mode={truncation_mode!r} is not supported; use one of "
                f"{TRUNCATION_MODES}"
            )
        if collator is None and not isinstance(pad_token_id, (int, np.integer)):
            raise ValueError(
                f"pad_token_id must be an int, got {pad_token_id!r}; if the tokenizer has no pad "
                "token, set one (e.g. tokenizer.pad_token = tokenizer.eos_token)"
            )
        self.name, self.seq_len, self.pad_token_id = name, seq_len, pad_token_id
        self.truncation_mode, self.collator = truncation_mode, collator

    def __call__(
        self, examples: list[dict[str, Any]], fill: np.ndarray, where: Sequence[Any]
    ) -> tuple[Batch, CollateStats | None]:
        """Batch of ``len(fill)`` rows: ``examples`` in the non-filler slots, in order.

        ``where`` names every slot's row in errors (None for fillers). Stats are None with a
        user collator, unless it counts its padding (a ``padding_tokens(batch)`` method, as the
        task collators have); the tokens examples say truncation cuts (``TRUNCATED_TOKENS``) too.
        """
        if self.collator is None:
            it = iter(examples)
            # An empty example collates to an all-pad, all-masked row: exactly a filler row.
            full = [{"input_ids": []} if f else next(it) for f in fill]
            return self._collate(full, list(where))
        cut = tokens_cut(examples)
        if any(TRUNCATED_TOKENS in e for e in examples):  # not the collator's input
            examples = [{k: v for k, v in e.items() if k != TRUNCATED_TOKENS} for e in examples]
        if fill.any():  # user collators get real rows; fillers are masked copies of one
            template = examples[0]
            it = iter(examples)
            examples = [dict(template) if f else next(it) for f in fill]
        batch = self._user_collate(examples, fill)
        padding_tokens = getattr(self.collator, "padding_tokens", None)
        if padding_tokens is None:
            return batch, None
        return batch, CollateStats(cut, int(padding_tokens(batch)))

    def _collate(self, examples: list[dict[str, Any]], where: list[Any]):
        try:
            return collate_examples(
                examples,
                seq_len=self.seq_len,
                pad_token_id=self.pad_token_id,
                truncation_mode=self.truncation_mode,
                return_stats=True,
            )
        except ValueError as exc:
            for example, w in zip(examples, where):
                if w is None:  # a filler row
                    continue
                try:
                    collate_examples([example], seq_len=self.seq_len, pad_token_id=0)
                except ValueError as row_exc:
                    raise DatasetError(f"{self.name} row {w}: {row_exc}") from row_exc
            raise DatasetError(f"{self.name}: {exc}") from exc

    def _user_collate(self, examples: list[dict[str, Any]], fill: np.ndarray) -> Batch:
        out = self.collator(examples)
        if not isinstance(out, Mapping):
            raise ValueError(
                f"data_collator must return a dict of arrays, got {type(out).__name__}"
            )
        batch = {k: np.asarray(v) for k, v in out.items()}
        for key, value in batch.items():
            if value.ndim == 0 or value.shape[0] != len(examples):
                raise ValueError(
                    f"data_collator output {key!r} has shape {value.shape}; its leading "
                    f"dimension must equal the number of examples ({len(examples)})"
                )
        if fill.any():
            if "labels" not in batch:
                raise ValueError(
                    "data_collator output has no 'labels', so filler rows cannot be masked out; "
                    "return 'labels' (with -100 for ignored positions)"
                )
            batch["labels"] = batch["labels"].copy()
            batch["labels"][fill] = IGNORE_INDEX
            if "attention_mask" in batch:
                batch["attention_mask"] = batch["attention_mask"].copy()
                batch["attention_mask"][fill] = 0
        return batch

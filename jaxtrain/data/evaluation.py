"""Eval batches: every eval row exactly once, in order, in fixed-shape batches.

The last batch is completed with filler rows (labels -100, attention_mask 0), so shapes are
fixed and a token-weighted loss over all batches is exact. Iterable eval data (streams,
generators) is read once into memory: eval sets are small and every process must run the
same number of batches. Eval rows are never packed (one document per row).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxtrain.data.assemble import Collation, Collator
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.loader import check_processes, prepare_source
from jaxtrain.data.sources import IterableSource, RandomAccessSource, as_source

__all__ = ["EvalLoader", "eval_batches", "num_eval_batches"]

_FILL = -1


class EvalLoader:
    """``[batch_size // process_count, seq_len]`` batches of this host's share of each batch."""

    def __init__(
        self,
        dataset: Any,
        *,
        batch_size: int,
        collation: Collation,
        featurizer: Featurizer,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"eval batch_size must be positive, got {batch_size}")
        check_processes(process_index, process_count, batch_size, "eval batch_size")
        name = featurizer.name
        source = as_source(dataset, name=name)
        if isinstance(source, IterableSource):
            prepare_source(source, featurizer)
            source = RandomAccessSource(list(source.iterate()), name=name)
        prepare_source(source, featurizer)
        self.source, self.collation, self.featurizer = source, collation, featurizer
        self.batch_size = batch_size
        self.process_index, self.process_count = process_index, process_count

    @property
    def num_batches(self) -> int:
        return -(-len(self.source) // self.batch_size)

    def batches(self, *, with_stats: bool = False) -> Iterator[Any]:
        n, b = len(self.source), self.batch_size
        per = b // self.process_count
        for k in range(self.num_batches):
            idx = np.arange(k * b, (k + 1) * b)
            idx[idx >= n] = _FILL
            idx = idx[self.process_index * per : (self.process_index + 1) * per]
            fill = idx == _FILL
            real = [int(i) for i in idx[~fill]] or [0]  # a template row for a user collator
            rows = self.featurizer(self.source.read(real), real)
            where = [None if f else int(i) for f, i in zip(fill, idx)]
            batch, stats = self.collation(rows, fill, where)
            yield (batch, stats) if with_stats else batch


def num_eval_batches(dataset: Any, *, batch_size: int) -> int:
    """How many batches ``eval_batches`` yields: ceil(rows / batch_size)."""
    if batch_size <= 0:
        raise ValueError(f"eval batch_size must be positive, got {batch_size}")
    return -(-len(dataset) // batch_size)


def eval_batches(
    dataset: Any,
    *,
    batch_size: int,
    seq_len: int,
    pad_token_id: int | None,
    truncation_mode: str = "keep_end",
    tokenizer: Any = None,
    text_column: str = "text",
    collator: Collator | None = None,
    process_index: int = 0,
    process_count: int = 1,
    name: str = "dataset_eval",
    with_stats: bool = False,
) -> Iterator[Any]:
    """Every eval row once (see EvalLoader); validation runs now, batch building lazily."""
    loader = EvalLoader(
        dataset,
        batch_size=batch_size,
        collation=Collation(
            name=name,
            seq_len=seq_len,
            pad_token_id=pad_token_id,
            truncation_mode=truncation_mode,
            collator=collator,
        ),
        featurizer=Featurizer(name=name, tokenizer=tokenizer, text_column=text_column),
        process_index=process_index,
        process_count=process_count,
    )
    return loader.batches(with_stats=with_stats)

"""A whole map-style token dataset checked at once, before anything is compiled.

Row-by-row checks (`Featurizer`) find a bad row only when its batch is read, possibly hours
into a run. For rows held in Arrow (a `datasets.Dataset`, small files' ``ArrowRows``) with an
`input_ids` column the whole column is checked here in one vectorised pass over its Arrow
buffers (no Python loop over rows): token ids against the model's vocabulary, whether any
row has a target token at all, and how many tokens truncation to max_sequence_length will
drop. Streams are checked row by row as read.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, bad_label_error, bad_labels
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.sources import RandomAccessSource

logger = logging.getLogger("jaxtrain")


@dataclasses.dataclass
class TokenScan:
    rows: int
    tokens: int
    # Tokens beyond max_sequence_length (in `long_rows` rows) that truncation drops.
    truncated_tokens: int
    long_rows: int
    sampled_from: int | None = None  # the source's row count when `rows` are a sample of it

    @classmethod
    def of(cls, lengths: np.ndarray, seq_len: int, sampled_from: int | None = None) -> TokenScan:
        """The scan of rows of these token `lengths` at `seq_len`."""
        over = np.maximum(lengths - seq_len, 0)
        return cls(
            rows=len(lengths),
            tokens=int(lengths.sum()),
            truncated_tokens=int(over.sum()),
            long_rows=int(np.count_nonzero(over)),
            sampled_from=sampled_from,
        )

    @property
    def truncated_share(self) -> float:
        return self.truncated_tokens / self.tokens if self.tokens else 0.0


def _flat(table: Any, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(all values of a list<int> column, the row of each value) as numpy arrays."""
    import pyarrow.compute as pc

    chunks = table.column(column).combine_chunks()
    values = pc.list_flatten(chunks).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(chunks).to_numpy(zero_copy_only=False)
    return values, parents


def scan_tokens(
    source: RandomAccessSource, *, vocab_size: int | None, seq_len: int
) -> TokenScan | None:
    """Check every row of an Arrow-held `input_ids` (and `labels`) column; None when the
    source has none (text rows are tokenized later, other sources checked per row)."""
    columns = source.columns or []
    if "input_ids" not in columns:
        return None
    wanted = [c for c in ("input_ids", "labels") if c in columns]
    table = source.arrow_table(wanted)  # in dataset row order
    if table is None:
        return None
    import pyarrow as pa  # only for rows held in Arrow, whose table it reads

    if not pa.types.is_list(table.schema.field("input_ids").type) and not pa.types.is_large_list(
        table.schema.field("input_ids").type
    ):
        return None  # not a list column: the per-row check names the problem
    ids, parents = _flat(table, "input_ids")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        return None
    name = source.name
    if ids.size:
        bad = ids < 0
        if vocab_size is not None:
            bad |= ids >= vocab_size
        if bad.any():
            first = int(np.argmax(bad))
            row = int(parents[first])
            in_row = ids[parents == row]
            raise DatasetError(
                f"{name} row {row}: column 'input_ids' holds token id {int(ids[first])} "
                f"(row's smallest {int(in_row.min())}, largest {int(in_row.max())}) but ids "
                f"must be in [0, vocab_size={vocab_size}); {int(bad.sum())} ids in "
                f"{len(np.unique(parents[bad]))} rows are out of range. Tokenize with the "
                "model's tokenizer, or set the model's vocab_size to cover them."
            )
    lengths = np.bincount(parents, minlength=len(table)) if ids.size else np.zeros(len(table))
    if "labels" in wanted:
        labels, label_rows = _flat(table, "labels")
        bad = bad_labels(labels, vocab_size) if labels.size else labels.astype(bool)
        if bad.any():
            first = int(np.argmax(bad))
            raise bad_label_error(name, int(label_rows[first]), int(labels[first]), vocab_size)
        targets = int(np.count_nonzero(labels != IGNORE_INDEX))
    else:
        targets = int(np.maximum(lengths - 1, 0).sum())  # each token predicts the next
    if targets == 0:
        raise _no_targets(name, len(table))
    return TokenScan.of(lengths, seq_len)


def _no_targets(name: str, rows: int) -> DatasetError:
    return DatasetError(
        f"{name} has no target tokens in any of its {rows} rows (every row is empty, one "
        "token long, or fully masked with labels -100): training on it would log a loss of 0 "
        "and learn nothing. Check the tokenization or the column you pass."
    )


def _targets(example: dict[str, Any]) -> int:
    """Tokens a row predicts (each token predicts the next; labels -100 are not targets)."""
    labels = np.asarray(example.get("labels", example["input_ids"]))
    if "labels" not in example:
        return max(len(labels) - 1, 0)
    return int(np.count_nonzero(labels[1:] != IGNORE_INDEX))


# Rows of text (or chat) data tokenized at the start to estimate what truncation drops: the
# whole dataset is tokenized only as it is read, so a long-row problem would otherwise show
# only in the end-of-run summary.
TRUNCATION_SAMPLE_ROWS = 256


def sample_scan(
    source: RandomAccessSource, featurize: Any, *, seq_len: int, rows: int = TRUNCATION_SAMPLE_ROWS
) -> TokenScan | None:
    """A TokenScan of up to `rows` rows spread over a text or chat `source`, featurized now
    (`featurize(rows, where)` -> token rows); None for an empty source."""
    n = len(source)
    if n == 0:
        return None
    indices = np.unique(np.linspace(0, n - 1, min(n, rows)).astype(int)).tolist()
    examples = featurize(source.read(indices), indices)
    lengths = np.asarray([len(e["input_ids"]) for e in examples])
    if not any(_targets(e) for e in examples):
        if len(examples) == n:
            raise _no_targets(source.name, n)
        logger.warning(
            "%s: none of the %d rows sampled from its %d has a token to learn from (empty "
            "text, one token, or no completion); check the data and its text_column.",
            source.name, len(examples), n,
        )  # fmt: skip
    return TokenScan.of(lengths, seq_len, sampled_from=n if len(lengths) < n else None)


def warn_truncation(
    scan: TokenScan | None, *, name: str, seq_len: int, mode: str, packing: bool = False
) -> None:
    """One warning with the share of tokens truncation drops (nothing when none); `packing`:
    on already (with split_long_documents off, or there would be no truncation)."""
    if scan is None or not scan.truncated_tokens:
        return
    sample = f" sampled from its {scan.sampled_from}" if scan.sampled_from else ""
    split = "split_long_documents=True" if packing else "packing=True"
    logger.warning(
        "%s: %.1f%% of its tokens (%d of %d, in %d of %d rows%s) are beyond "
        "max_sequence_length=%d and are dropped (truncation_mode=%s). Raise "
        "max_sequence_length, or use %s to split long documents instead.",
        name,
        100 * scan.truncated_share,
        scan.truncated_tokens,
        scan.tokens,
        scan.long_rows,
        scan.rows,
        sample,
        seq_len,
        mode,
        split,
    )

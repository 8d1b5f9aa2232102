"""Every row of a map-style dataset put through its featurizer's row check before anything
is compiled.

A featurizer checks each row's task columns as the row is read (`Featurizer.check_row`):
a bad row 390 of 400 then failed after compiling and 35 steps, and dropping it, as the
message advised, changed the dataset under the run's checkpoints so the resume was refused.
Here the same check covers every row at the start. For rows held in Arrow (a
`datasets.Dataset`, small files' ``ArrowRows``) the column types and Arrow compute decide
which rows surely pass (`ColumnRule`); only the others are read and put through the per-row
check itself, so there is one definition of each rule and the messages are the per-row ones.
Lists of rows in memory go the same way (long ones through Arrow too); other random-access
sources (Grain, TFDS: a read of every row) and streams keep the check as read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ColumnRule", "check_all_rows", "is_finite_number"]

KINDS = ("str", "messages", "bool", "number")


def is_finite_number(value: Any) -> bool:
    """An int or a finite float (a bool is no number here): a NaN margin or weight would
    reach the loss as a NaN, reported as a diverging run."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return bool(np.isfinite(value))


READ_ROWS = 1024  # rows read at a time when Arrow cannot decide them
LOOP_ROWS = 20_000  # a list of fewer rows is looped over (no pyarrow import)


@dataclasses.dataclass(frozen=True)
class ColumnRule:
    """What surely passes a featurizer's row check in `column`: a value of one of `kinds`
    ("str"; "messages": a list of role/content mappings; "bool": True/False or 0/1;
    "number": a finite one), an empty one ("" or []) only when `empty_ok`, a null only when
    `null_ok`. Only a shortcut: a value it does not vouch for goes through the row check."""

    column: str
    kinds: tuple[str, ...]
    empty_ok: bool = False
    null_ok: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"ColumnRule kinds must be among {KINDS}, got {sorted(unknown)}")


def _passing_chunk(arr: Any, rule: ColumnRule) -> np.ndarray:
    """For each value of one Arrow array: whether `rule` vouches for it."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t, n = arr.type, len(arr)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    ok = np.zeros(n, bool)
    is_str = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
    if "str" in rule.kinds and is_str:
        ok = valid.copy()
        if not rule.empty_ok:
            ok &= pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False) > 0
    elif "messages" in rule.kinds and is_list and pa.types.is_struct(t.value_type):
        ok = valid.copy()
        if not rule.empty_ok:
            ok &= pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False) > 0
        flat = pc.list_flatten(arr)
        if flat.null_count:  # a null message is no mapping
            parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
            ok[parents[flat.is_null().to_numpy(zero_copy_only=False)]] = False
    elif "bool" in rule.kinds and pa.types.is_boolean(t):
        ok = valid.copy()
    elif "bool" in rule.kinds and pa.types.is_integer(t):
        values = arr.fill_null(-1).to_numpy(zero_copy_only=False)
        ok = valid & ((values == 0) | (values == 1))
    elif "number" in rule.kinds and pa.types.is_integer(t):
        ok = valid.copy()
    elif "number" in rule.kinds and pa.types.is_floating(t):  # a finite one: NaN/inf go on
        ok = valid & np.isfinite(arr.fill_null(0).to_numpy(zero_copy_only=False))
    if rule.null_ok:
        ok |= ~valid
    return ok


def _passing(column: Any, rule: ColumnRule) -> np.ndarray:
    chunks = [_passing_chunk(chunk, rule) for chunk in column.chunks]
    return np.concatenate(chunks) if chunks else np.zeros(0, bool)


def _vouched(table: Any, rules: tuple[ColumnRule, ...]) -> np.ndarray:
    ok = np.ones(len(table), bool)
    for rule in rules:
        ok &= _passing(table.column(rule.column), rule)
    return ok


def _list_undecided(rows: Any, rules: tuple[ColumnRule, ...]) -> np.ndarray:
    """Indices of the rows of a list of dicts the rules do not vouch for: a long list's
    columns go through Arrow (a million rows looped over took 2.7 s), a short one is
    looped over, as is one whose values Arrow cannot hold in one column (mixed kinds)."""
    if len(rows) < LOOP_ROWS:
        return np.arange(len(rows))
    import pyarrow as pa

    mapping = np.fromiter((isinstance(r, Mapping) for r in rows), bool, len(rows))
    columns = list(dict.fromkeys(r.column for r in rules))
    try:
        table = pa.table(
            {c: pa.array([r.get(c) if m else None for r, m in zip(rows, mapping)]) for c in columns}
        )
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return np.arange(len(rows))
    return np.flatnonzero(~(_vouched(table, rules) & mapping))


def _undecided(source: Any, rules: tuple[ColumnRule, ...]) -> np.ndarray | None:
    """Indices of the rows the rules do not vouch for (ascending), or None when the rows
    are neither held in Arrow nor a list in memory."""
    if isinstance(source.data, (list, tuple)):
        return _list_undecided(source.data, rules)
    columns = source.columns
    if columns is None:
        return None
    present = list(dict.fromkeys(r.column for r in rules))
    if any(c not in columns for c in present):  # an absent column: the row check says so
        return np.arange(len(source))
    stored = source.arrow_storage(present)
    if stored is None:
        return None
    table, order = stored  # decided in storage order: a shuffled dataset needs no take
    ok = _vouched(table, rules)
    return np.flatnonzero(~(ok if order is None else ok[order]))


def check_all_rows(source: Any, featurizer: Any) -> None:
    """Put every row of a random-access `source` through `featurizer.check_row` (raising its
    DatasetError for the first bad row), after `featurizer.detect`; rows Arrow vouches for
    by the featurizer's `row_rules()` are not read."""
    if not getattr(source, "random_access", False):
        return  # a stream: checked as read
    row_rules = getattr(featurizer, "row_rules", None)  # a caller's own featurizer may lack it
    rules = tuple(row_rules()) if row_rules is not None else ()
    n = len(source)
    if not rules or n == 0:
        return
    rows = _undecided(source, rules)
    if rows is None:
        return  # a read of every row (Grain, TFDS): checked as read
    for start in range(0, len(rows), READ_ROWS):
        indices = [int(i) for i in rows[start : start + READ_ROWS]]
        for row, where in zip(source.read(indices), indices):
            featurizer.check_row(row, where)

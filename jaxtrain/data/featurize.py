"""Rows -> token examples: pre-tokenized ids, raw text, or chat messages.

A row becomes ``{"input_ids", optional "labels", optional "attention_mask"}``. Which kind a
dataset holds is decided once from its first row (``detect``); every row is then checked as
it is read, and a bad one raises ``DatasetError`` naming the dataset, row, column and fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.data.chat import render_chat
from jaxtrain.data.collate import bad_label_error, bad_labels
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.row_checks import ColumnRule

__all__ = ["Featurizer", "is_int_sequence"]

Row = dict[str, Any]
TOKEN_COLUMNS = ("input_ids", "labels", "attention_mask")


def is_int_sequence(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and (np.issubdtype(value.dtype, np.integer) or value.size == 0)
    if not isinstance(value, (list, tuple)):
        return False
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)


def _describe(value: Any) -> str:
    return f"{type(value).__name__}: {str(value)[:60]!r}"


class Featurizer:
    """Turns raw rows into token examples, the same way for every source."""

    # How its examples become batches when they carry more than tokens (data/vision.py's
    # images); None: the pipeline's pad/truncate collation.
    collator: Any = None
    # Whether its rows' images are read (data/images.py); a featurizer that does not read them
    # refuses rows that hold some (data/loader.py prepare_source).
    takes_images = False

    def __init__(
        self,
        *,
        name: str,
        tokenizer: Any = None,
        text_column: str = "text",
        messages_column: str = "messages",
        completion_only_loss: bool = False,
        chat_template: str | None = None,
        drop_columns: Sequence[str] = (),
    ) -> None:
        self.name, self.tokenizer = name, tokenizer
        self.text_column, self.messages_column = text_column, messages_column
        self.completion_only_loss, self.chat_template = completion_only_loss, chat_template
        self.drop_columns = tuple(drop_columns)
        self.mode: str | None = None
        # The model's vocabulary size: token ids outside [0, vocab_size) are an error.
        self.vocab_size: int | None = None

    # ------------------------------------------------------------------ detect
    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        """Decide the row kind from the first row; returns "input_ids", "text" or "messages"."""
        if not isinstance(first, Mapping):
            raise DatasetError(
                f"{self.name} row 0 is a {type(first).__name__}, expected a dict such as "
                f"{{'input_ids': [...]}} or {{{self.text_column!r}: '...'}}"
            )
        row = self.drop(dict(first))
        available = sorted(row) if columns is None else [c for c in columns if c in row]
        if "input_ids" in row:
            value = row["input_ids"]
            if not is_int_sequence(np.asarray(value) if _is_array_like(value) else value):
                raise DatasetError(
                    f"{self.name} column 'input_ids' must hold sequences of ints (token ids); "
                    f"row 0 has {_describe(value)}. Available columns: {available}. Put raw "
                    f"text in the {self.text_column!r} column and pass processing_class=<tokenizer>"
                )
            self.mode = "input_ids"
        elif self.messages_column in row:
            if self.tokenizer is None or not hasattr(self.tokenizer, "apply_chat_template"):
                raise DatasetError(
                    f"{self.name} has a chat column {self.messages_column!r} but no tokenizer "
                    "with a chat template; pass processing_class=<HF tokenizer>"
                )
            if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
                raise DatasetError(
                    f"{self.name}: column {self.messages_column!r} holds chat messages but the "
                    "tokenizer has no chat_template; set TrainingArguments.chat_template to a "
                    "Jinja template (or use a tokenizer that has one)"
                )
            self.mode = "messages"
        elif self.text_column in row:
            if self.tokenizer is None:
                raise DatasetError(
                    f"{self.name} has a text column {self.text_column!r} but no tokenizer was "
                    "given; pass processing_class=<tokenizer> (or pre-tokenize into an "
                    "'input_ids' column)"
                )
            self.mode = "text"
        else:
            raise DatasetError(
                f"{self.name} has neither an 'input_ids' column nor the text column "
                f"{self.text_column!r} nor the chat column {self.messages_column!r}; available "
                f"columns: {available}. Set text_column=/messages_column= to the right name or "
                "tokenize the data into 'input_ids'"
            )
        return self.mode

    # ------------------------------------------------------------- row checks
    def row_rules(self) -> tuple[ColumnRule, ...]:
        """After `detect`: what surely passes `check_row`, column by column, for the
        up-front check of every row (data/row_checks.py); () when it has no such check."""
        if self.mode == "text":
            return (ColumnRule(self.text_column, ("str",), empty_ok=True),)
        return ()

    def check_row(self, row: Row, where: Any) -> None:
        """DatasetError naming `where` unless the row passes the checks that need no
        tokenizer; run on every row of a map-style dataset before anything compiles."""
        if self.mode == "text":
            self._text_of(row, where)

    def drop(self, row: Row) -> Row:
        for key in self.drop_columns:
            row.pop(key, None)
        return row

    # ---------------------------------------------------------------- featurize
    def __call__(self, rows: list[Row], where: Sequence[Any]) -> list[Row]:
        """Token examples for ``rows``; ``where[i]`` names row i in errors (its index)."""
        if self.mode is None and rows:  # one-shot iterators cannot be peeked at beforehand
            self.detect(rows[0])
        rows = [self.drop(dict(r)) for r in rows]
        if self.mode == "text":
            self._tokenize(rows, where)
        elif self.mode == "messages":
            for row, w in zip(rows, where):
                row.update(self._chat(row, w))
        for row, w in zip(rows, where):
            self.check_tokens(row, w)
        return rows

    def check_tokens(self, row: Row, where: Any) -> None:
        """DatasetError naming `where` unless the row's token columns are aligned 1-D ints
        of the model's vocabulary."""
        if "input_ids" not in row:
            raise DatasetError(
                f"{self.name} row {where} has no 'input_ids' (columns: {sorted(row)}); every "
                "row must have the same columns as row 0"
            )
        length = None
        for column in TOKEN_COLUMNS:
            value = row.get(column)
            if value is None:
                continue
            arr = np.asarray(value)
            if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
                raise DatasetError(
                    f"{self.name} row {where}: column {column!r} must be a 1-D sequence of ints, "
                    f"got {_describe(value)} (dtype {arr.dtype}); fix or drop that row, or "
                    f"drop the column with ids_to_pop_from_dataset=[{column!r}]"
                )
            if column == "input_ids" and arr.size:
                self._check_ids(arr, where)
            if column == "labels" and arr.size and (bad := bad_labels(arr, self.vocab_size)).any():
                raise bad_label_error(self.name, where, int(arr[bad][0]), self.vocab_size)
            if length is None:
                length = len(arr)
            elif len(arr) != length:
                raise DatasetError(
                    f"{self.name} row {where}: column {column!r} has length {len(arr)} but "
                    f"'input_ids' has length {length}; they must be aligned token by token"
                )

    def _check_ids(self, ids: np.ndarray, where: Any) -> None:
        low, high = int(ids.min()), int(ids.max())
        limit = self.vocab_size
        if low < 0 or (limit is not None and high >= limit):
            raise DatasetError(
                f"{self.name} row {where}: column 'input_ids' holds ids from {low} to {high} "
                f"but ids must be in [0, vocab_size={limit}). Tokenize with the model's "
                "tokenizer, or set the model's vocab_size to cover them."
            )

    def _text_of(self, row: Row, where: Any) -> str:
        text = row.get(self.text_column)
        if isinstance(text, bytes):  # TFDS text features
            text = text.decode("utf-8")
        if text is None:  # a key the row lacks reads as null in a file's table
            raise DatasetError(
                f"{self.name} row {where}: column {self.text_column!r} is missing (or null); "
                "give every row its text, or drop that row"
            )
        if not isinstance(text, str):
            raise DatasetError(
                f"{self.name} row {where}: column {self.text_column!r} is "
                f"{type(text).__name__}, expected str; fix or drop that row"
            )
        return text

    def _tokenize(self, rows: list[Row], where: Sequence[Any]) -> None:
        texts = [self._text_of(row, w) for row, w in zip(rows, where)]
        if not texts:
            return
        try:
            encoded = self.tokenizer(texts)["input_ids"]
        except Exception:
            for text, w in zip(texts, where):  # find the culprit row so the error names it
                try:
                    self.tokenizer([text])
                except Exception as exc:
                    raise DatasetError(
                        f"{self.name} row {w}: the tokenizer failed on column "
                        f"{self.text_column!r}: {exc}; fix or drop that row"
                    ) from exc
            raise
        for row, ids in zip(rows, encoded):
            row["input_ids"] = ids

    def _chat(self, row: Row, where: Any) -> Row:
        messages = row.get(self.messages_column)
        try:
            return render_chat(
                self.tokenizer,
                messages,
                completion_only_loss=self.completion_only_loss,
                chat_template=self.chat_template,
            )
        except DatasetError as exc:
            raise DatasetError(
                f"{self.name} row {where}, column {self.messages_column!r}: {exc}"
            ) from exc
        except Exception as exc:
            raise DatasetError(
                f"{self.name} row {where}: rendering column {self.messages_column!r} with the "
                f"chat template failed: {type(exc).__name__}: {exc}; fix or drop that row"
            ) from exc


def _is_array_like(value: Any) -> bool:
    return isinstance(value, np.ndarray) or type(value).__module__.startswith(("pyarrow", "jax"))

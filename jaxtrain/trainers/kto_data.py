"""KTO's rows: unpaired examples (``prompt``, ``completion``, ``label``), in TRL's format.

``label`` is True (or 1) for a desirable completion, False (0) for an undesirable one;
``prompt`` and ``completion`` are strings or lists of ``{"role", "content"}`` messages, encoded
and truncated as the pair trainers' (trainers/data.py: the response is kept, the prompt loses
its first tokens). Preference pairs (``prompt``, ``chosen``, ``rejected``) are unpaired first
(``unpair_preferences``): each pair gives a desirable and an undesirable example.

The KL estimate of KTO needs, for every example, its prompt followed by *another* example's
completion: the collator builds them by rotating the completions by one within each
micro-batch's rows (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), as TRL does within each
device batch, so the mismatched completions are the same set as the matched ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, TRUNCATED_TOKENS, masked_positions
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.row_checks import ColumnRule
from jaxtrain.trainers.data import (
    Encoder,
    check_prompt,
    check_value,
    is_messages,
    response_rules,
    shared_prefix,
    truncate_keep_response,
)

__all__ = ["KTOCollator", "KTOFeaturizer", "rotated", "unpair_preferences"]


def _unpair_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        chosen, rejected = row["chosen"], row["rejected"]
        if "prompt" in row:
            prompt = row["prompt"]
        else:  # implicit prompt: the messages both conversations start with
            n = shared_prefix(list(chosen), list(rejected))
            prompt, chosen, rejected = list(chosen[:n]), list(chosen[n:]), list(rejected[n:])
        out.append({"prompt": prompt, "completion": chosen, "label": True})
        out.append({"prompt": prompt, "completion": rejected, "label": False})
    return out


def unpair_preferences(dataset: Any) -> Any:
    """Preference pairs -> KTO examples: (prompt, chosen, True), (prompt, rejected, False),
    in the order of the pairs. A `datasets.Dataset` stays one (mapped); other row sources
    become a list of rows."""
    if hasattr(dataset, "map") and hasattr(dataset, "column_names"):

        def unpair(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
            keys = list(batch)
            rows = [dict(zip(keys, values)) for values in zip(*batch.values())]
            unpaired = _unpair_rows(rows)
            return {k: [r[k] for r in unpaired] for k in ("prompt", "completion", "label")}

        return dataset.map(unpair, batched=True, remove_columns=list(dataset.column_names))
    if isinstance(dataset, Mapping):  # a dict of columns
        keys = list(dataset)
        rows = [dict(zip(keys, values)) for values in zip(*dataset.values())]
        return _unpair_rows(rows)
    return _unpair_rows(list(dataset))


def is_paired(columns: Sequence[str]) -> bool:
    return "chosen" in columns and "rejected" in columns and "completion" not in columns


class KTOFeaturizer(Featurizer):
    """KTO rows -> ``{"prompt_ids", "completion_ids", "label"}`` (one example per row)."""

    def __init__(self, *, name: str, tokenizer: Any, max_length: int, chat_template=None):
        super().__init__(name=name, tokenizer=tokenizer, chat_template=chat_template)
        self.max_length = max_length
        self.conversational = False

    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        if not isinstance(first, Mapping):
            raise DatasetError(
                f"{self.name} row 0 is a {type(first).__name__}, expected a dict with "
                "'prompt', 'completion' and 'label'"
            )
        available = sorted(first) if columns is None else list(columns)
        missing = [c for c in ("prompt", "completion", "label") if c not in first]
        if missing:
            raise DatasetError(
                f"{self.name} has no column {missing[0]!r}: KTO reads unpaired rows 'prompt', "
                "'completion', 'label' (True: desirable) or preference pairs 'prompt', "
                f"'chosen', 'rejected'; available columns: {available}"
            )
        self.conversational = is_messages(first["completion"])
        self.encoder = Encoder(self.tokenizer, self.chat_template, self.name, self.conversational)
        self.mode = "kto"
        return self.mode

    def __call__(self, rows: list[dict[str, Any]], where: Sequence[Any]) -> list[dict[str, Any]]:
        if self.mode is None and rows:
            self.detect(rows[0])
        return [self._example(row, w) for row, w in zip(rows, where)]

    def row_rules(self) -> tuple[ColumnRule, ...]:
        rules = response_rules(("completion",), self.conversational, prompt=True)
        return rules + (ColumnRule("label", ("bool",)),)

    def check_row(self, row: Mapping[str, Any], where: Any) -> None:
        for column in ("prompt", "completion", "label"):
            if column not in row:
                raise DatasetError(f"{self.name} row {where} has no column {column!r}")
        check_value(self.name, where, "completion", row["completion"], self.conversational)
        label = row["label"]
        if not isinstance(label, (bool, np.bool_, int, np.integer)) or int(label) not in (0, 1):
            raise DatasetError(
                f"{self.name} row {where}: column 'label' must be True/False (desirable or "
                f"not), got {label!r}"
            )
        check_prompt(self.name, where, row["prompt"], messages=self.conversational)

    def _example(self, row: Mapping[str, Any], where: Any) -> dict[str, Any]:
        self.check_row(row, where)
        label = row["label"]
        prompt = row["prompt"]
        if self.conversational and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        try:
            prompt_ids, completion_ids = self.encoder.encode(prompt, row["completion"])
        except DatasetError as exc:
            raise DatasetError(f"{self.name} row {where}: {exc}") from exc
        return {
            "prompt_ids": np.asarray(prompt_ids, np.int64),
            "completion_ids": np.asarray(completion_ids, np.int64),
            "label": float(label),
            # What kto_sequence will cut of it (its KL sequence's cut is not the data's).
            TRUNCATED_TOKENS: max(len(prompt_ids) + len(completion_ids) - self.max_length, 0),
        }


def rotated(n: int, group: int) -> np.ndarray:
    """For each of n rows, the row whose completion its KL sequence takes: the previous row
    within consecutive groups of `group` rows (the first row takes its group's last)."""
    source = np.arange(n)
    for start in range(0, n, max(group, 1)):
        end = min(start + group, n)
        source[start:end] = np.roll(np.arange(start, end), 1)
    return source


def kto_sequence(prompt: np.ndarray, completion: np.ndarray, t: int) -> tuple[np.ndarray, ...]:
    """(ids, labels) of prompt + completion cut to t tokens by the pair trainers' rule."""
    p, c = truncate_keep_response(prompt, completion, t)
    return np.asarray(p + c, np.int64), np.asarray([IGNORE_INDEX] * len(p) + c, np.int64)


class KTOCollator:
    """KTO examples -> ``input_ids``/``labels``/``attention_mask`` [N, seq_len] (prompt +
    completion, right-padded), ``label`` [N] (1.0 desirable) and, with `kl`, ``KL_input_ids``/
    ``KL_labels``/``KL_attention_mask``: each prompt with the completion of the row before it
    within groups of `group` rows (the micro-batch's rows on this process)."""

    def __init__(self, seq_len: int, pad_token_id: int, *, group: int, kl: bool = True):
        self.seq_len, self.pad_token_id, self.group, self.kl = seq_len, pad_token_id, group, kl

    padding_tokens = staticmethod(masked_positions)  # the meter's count (data/assemble.py)

    def sequences(self, examples: list[dict[str, Any]]) -> dict[str, list[tuple[np.ndarray, ...]]]:
        """(ids, labels) of each example's sequence and, with `kl`, of its KL sequence."""
        t = self.seq_len
        out = {"": [kto_sequence(e["prompt_ids"], e["completion_ids"], t) for e in examples]}
        if self.kl:
            source = rotated(len(examples), self.group)
            out["KL_"] = [
                kto_sequence(e["prompt_ids"], examples[j]["completion_ids"], t)
                for e, j in zip(examples, source)
            ]
        return out

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        n, t, pad = len(examples), self.seq_len, int(self.pad_token_id)
        batch: dict[str, np.ndarray] = {}
        for prefix, sequences in self.sequences(examples).items():
            ids = np.full((n, t), pad, np.int32)
            labels = np.full((n, t), IGNORE_INDEX, np.int32)
            mask = np.zeros((n, t), np.int32)
            for i, (seq, lab) in enumerate(sequences):
                ids[i, : len(seq)], labels[i, : len(seq)], mask[i, : len(seq)] = seq, lab, 1
            batch[f"{prefix}input_ids"], batch[f"{prefix}labels"] = ids, labels
            batch[f"{prefix}attention_mask"] = mask
        batch["label"] = np.asarray([e["label"] for e in examples], np.float32)
        return batch

"""Rows of the task trainers, in the Hugging Face ecosystem's conventions.

- SFT: ``text``, ``messages`` (the base Featurizer) or ``prompt`` + ``completion``.
- Preference pairs (DPO, reward model): ``prompt``, ``chosen``, ``rejected``, each a string or
  a list of ``{"role", "content"}`` messages (then rendered with the chat template; without a
  ``prompt`` column the prompt is the messages ``chosen`` and ``rejected`` share). Optional
  columns: ``reference_chosen_logps`` / ``reference_rejected_logps`` (DPO, precomputed) and
  ``margin`` (reward model).

Truncation rule (prompt + response longer than ``max_sequence_length`` = L): the response is
kept and the prompt loses its *first* tokens, so the text right before the response survives.
A response longer than L on its own keeps its first L tokens and no prompt. Prompt tokens
carry label -100; string completions end with the tokenizer's eos token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, TRUNCATED_TOKENS, masked_positions
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.row_checks import ColumnRule, is_finite_number

__all__ = [
    "PAIR_FLOAT_COLUMNS",
    "PairCollator",
    "PairFeaturizer",
    "SFTFeaturizer",
    "encode_prompt_completion",
    "truncate_keep_response",
]

PAIR_FLOAT_COLUMNS = ("reference_chosen_logps", "reference_rejected_logps", "margin")


def truncate_keep_response(
    prompt: Sequence[int], response: Sequence[int], max_length: int
) -> tuple[list[int], list[int]]:
    """(prompt, response) cut to at most `max_length` tokens together, by the module's rule."""
    prompt, response = list(prompt), list(response)
    if len(response) >= max_length:
        return [], response[:max_length]
    keep = max_length - len(response)
    return prompt[len(prompt) - keep :] if len(prompt) > keep else prompt, response


def is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(m, Mapping) for m in value)


class Encoder:
    """Tokenizes (prompt, completion) pairs of strings or message lists."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None, name: str, conversational: bool = False
    ):
        if tokenizer is None:
            raise DatasetError(
                f"{name} holds text rows but no tokenizer was given; pass "
                "processing_class=<HF tokenizer>"
            )
        if (
            conversational
            and chat_template is None
            and not getattr(tokenizer, "chat_template", None)
        ):
            raise DatasetError(
                f"{name} holds chat messages but the tokenizer has no chat_template; set the "
                "arguments' chat_template (--chat_template) to a Jinja template, or use a "
                "tokenizer that has one"
            )
        self.tokenizer, self.chat_template, self.name = tokenizer, chat_template, name

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=self.chat_template,
        )

    def _ids(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def encode(self, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
        if is_messages(completion):
            prompt_msgs = list(prompt or [])
            prompt_text = self._render(prompt_msgs, True) if prompt_msgs else ""
            full = self._render(prompt_msgs + list(completion), False)
            if not full.startswith(prompt_text):
                raise DatasetError(
                    "the chat template does not render the prompt as a prefix of prompt + "
                    "response, so the response cannot be told apart; use a prefix-stable "
                    "chat_template"
                )
            return self._ids(prompt_text, False), self._ids(full[len(prompt_text) :], False)
        prompt_ids = self._ids(prompt, True) if prompt else []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return prompt_ids, self._ids(completion, not prompt) + ([eos] if eos is not None else [])


def encode_prompt_completion(
    encoder: Encoder, prompt: Any, completion: Any, max_length: int
) -> dict[str, np.ndarray]:
    """``{"input_ids", "labels", TRUNCATED_TOKENS}`` of one prompt + response, prompt labels
    -100, and how many of its tokens truncation cut."""
    prompt_ids, response_ids = encoder.encode(prompt, completion)
    p, c = truncate_keep_response(prompt_ids, response_ids, max_length)
    ids = np.asarray(p + c, np.int64)
    labels = np.asarray([IGNORE_INDEX] * len(p) + c, np.int64)
    cut = len(prompt_ids) + len(response_ids) - len(ids)
    return {"input_ids": ids, "labels": labels, TRUNCATED_TOKENS: cut}


def encode_scored_response(
    tokenizer: Any,
    prompt: Any,
    completion: Any,
    max_length: int,
    chat_template: str | None = None,
) -> np.ndarray:
    """Token ids of prompt + completion as the pair trainers encode a response (so a reward
    model scores GRPO's completions as it saw its chosen and rejected rows); a text
    completion of a chat prompt is the assistant's reply."""
    if is_messages(prompt) and isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    encoder = Encoder(tokenizer, chat_template, "reward_model")
    return encode_prompt_completion(encoder, prompt, completion, max_length)["input_ids"]


def check_value(name: str, where: Any, column: str, value: Any, conversational: bool) -> None:
    empty = value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0)
    if empty:  # a column a row lacks reads as null (Arrow fills it)
        state = "missing (null)" if value is None else "empty"
        raise DatasetError(
            f"{name} row {where}: column {column!r} is {state}; every row needs a non-empty "
            f"{column!r} (fix or drop that row)"
        )
    if conversational and not is_messages(value):
        raise DatasetError(
            f"{name} row {where}: column {column!r} must be a list of {{'role', 'content'}} "
            f"messages like row 0, got {type(value).__name__}"
        )
    if not conversational and not isinstance(value, str):
        raise DatasetError(
            f"{name} row {where}: column {column!r} must be a string like row 0, got "
            f"{type(value).__name__}: {str(value)[:60]!r}"
        )


def check_prompt(
    name: str, where: Any, value: Any, *, strings: bool = True, messages: bool = False
) -> None:
    """A prompt may be missing or empty (the response stands alone); else a string (when
    `strings`) or a list of messages (when `messages`), as the encoder reads it."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return
    if (strings and isinstance(value, str)) or (messages and is_messages(value)):
        return
    kinds = [k for k, on in (("a string", strings), ("a list of messages", messages)) if on]
    raise DatasetError(
        f"{name} row {where}: column 'prompt' must be {' or '.join(kinds)} like row 0, got "
        f"{type(value).__name__}: {str(value)[:60]!r}"
    )


def response_rules(
    columns: Sequence[str], conversational: bool, *, prompt: bool
) -> tuple[ColumnRule, ...]:
    """What surely passes `check_value` in these response columns and, with `prompt`,
    `check_prompt` (a chat row's prompt may be a string, as the pair trainers wrap it)."""
    kind = ("messages",) if conversational else ("str",)
    rules = tuple(ColumnRule(c, kind) for c in columns)
    if prompt:
        kinds = ("str", "messages") if conversational else ("str",)
        rules += (ColumnRule("prompt", kinds, empty_ok=True, null_ok=True),)
    return rules


def shared_prefix(a: list[Any], b: list[Any]) -> int:
    n = 0
    while n < min(len(a), len(b)) - 1 and a[n] == b[n]:
        n += 1
    return n


class PairFeaturizer(Featurizer):
    """Preference rows -> ``chosen_*``/``rejected_*`` token examples (one pair per row)."""

    def __init__(self, *, name: str, tokenizer: Any, max_length: int, chat_template=None):
        super().__init__(name=name, tokenizer=tokenizer, chat_template=chat_template)
        self.max_length = max_length
        self.conversational = False
        self.has_prompt = True
        self.float_columns: tuple[str, ...] = ()

    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        if not isinstance(first, Mapping):
            raise DatasetError(
                f"{self.name} row 0 is a {type(first).__name__}, expected a dict with "
                "'prompt', 'chosen' and 'rejected'"
            )
        available = sorted(first) if columns is None else list(columns)
        missing = [c for c in ("chosen", "rejected") if c not in first]
        if missing:
            raise DatasetError(
                f"{self.name} has no column {missing[0]!r}: preference data needs 'chosen' and "
                f"'rejected' (and usually 'prompt'); available columns: {available}. Rename "
                "the columns (e.g. dataset.rename_column('answer_good', 'chosen'))"
            )
        self.conversational = is_messages(first["chosen"])
        self.has_prompt = "prompt" in first
        if not self.has_prompt and not self.conversational:
            raise DatasetError(
                f"{self.name} has string 'chosen'/'rejected' but no 'prompt' column; add the "
                f"prompt column (available columns: {available})"
            )
        if self.conversational and self.tokenizer is None:
            raise DatasetError(
                f"{self.name} holds chat messages but no tokenizer was given; pass "
                "processing_class=<HF tokenizer with a chat template>"
            )
        self.encoder = Encoder(self.tokenizer, self.chat_template, self.name, self.conversational)
        self.float_columns = tuple(c for c in PAIR_FLOAT_COLUMNS if c in first)
        self.mode = "pairs"
        return self.mode

    def __call__(self, rows: list[dict[str, Any]], where: Sequence[Any]) -> list[dict[str, Any]]:
        if self.mode is None and rows:
            self.detect(rows[0])
        return [self._pair(row, w) for row, w in zip(rows, where)]

    def row_rules(self) -> tuple[ColumnRule, ...]:
        rules = response_rules(("chosen", "rejected"), self.conversational, prompt=self.has_prompt)
        return rules + tuple(ColumnRule(c, ("number",)) for c in self.float_columns)

    def check_row(self, row: Mapping[str, Any], where: Any) -> None:
        for column in ("chosen", "rejected"):
            if column not in row:
                raise DatasetError(f"{self.name} row {where} has no column {column!r}")
            check_value(self.name, where, column, row[column], self.conversational)
        if self.has_prompt:
            check_prompt(self.name, where, row.get("prompt"), messages=self.conversational)
        for column in self.float_columns:
            value = row.get(column)
            if not is_finite_number(value):
                raise DatasetError(
                    f"{self.name} row {where}: column {column!r} must be a finite number, got "
                    f"{value!r}"
                )

    def _pair(self, row: Mapping[str, Any], where: Any) -> dict[str, Any]:
        self.check_row(row, where)
        chosen, rejected = row["chosen"], row["rejected"]
        if self.has_prompt:
            prompt = row.get("prompt")
            if self.conversational and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
        else:  # implicit prompt: the messages both conversations start with
            n = shared_prefix(list(chosen), list(rejected))
            prompt, chosen, rejected = list(chosen[:n]), list(chosen[n:]), list(rejected[n:])
        out: dict[str, Any] = {TRUNCATED_TOKENS: 0}
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            try:
                example = encode_prompt_completion(
                    self.encoder, prompt, completion, self.max_length
                )
            except DatasetError as exc:
                raise DatasetError(f"{self.name} row {where}, column {side!r}: {exc}") from exc
            out[f"{side}_input_ids"], out[f"{side}_labels"] = (
                example["input_ids"],
                example["labels"],
            )
            out[TRUNCATED_TOKENS] += example[TRUNCATED_TOKENS]
        for column in self.float_columns:
            out[column] = float(row[column])
        return out


class PairCollator:
    """Pair examples -> a batch: ``input_ids``/``labels``/``attention_mask`` of the chosen
    responses, ``rejected_*`` of the rejected ones ([N, seq_len] each, right-padded) and
    float columns [N], padded with `pad_token_id`."""

    def __init__(self, seq_len: int, pad_token_id: int = 0):
        self.seq_len, self.pad_token_id = seq_len, int(pad_token_id)

    padding_tokens = staticmethod(masked_positions)  # the meter's count (data/assemble.py)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        n, t, pad = len(examples), self.seq_len, self.pad_token_id
        batch: dict[str, np.ndarray] = {}
        for side, prefix in (("chosen", ""), ("rejected", "rejected_")):
            ids = np.full((n, t), pad, np.int32)
            labels = np.full((n, t), IGNORE_INDEX, np.int32)
            mask = np.zeros((n, t), np.int32)
            for i, example in enumerate(examples):
                seq, lab = example[f"{side}_input_ids"][:t], example[f"{side}_labels"][:t]
                ids[i, : len(seq)], labels[i, : len(seq)], mask[i, : len(seq)] = seq, lab, 1
            batch[f"{prefix}input_ids"], batch[f"{prefix}labels"] = ids, labels
            batch[f"{prefix}attention_mask"] = mask
        for column in PAIR_FLOAT_COLUMNS:
            if column in examples[0]:
                batch[column] = np.asarray([e[column] for e in examples], np.float32)
        return batch


class SFTFeaturizer(Featurizer):
    """The base rows (``text``, ``messages``, ``input_ids``) plus ``prompt`` + ``completion``
    (strings or message lists; completion-only loss follows ``completion_only_loss``)."""

    def __init__(self, *, max_length: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.max_length = max_length
        self.conversational = False

    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        base_columns = ("input_ids", self.messages_column, self.text_column)
        if (
            isinstance(first, Mapping)
            and "prompt" in first
            and "completion" in first
            and not any(c in first for c in base_columns)
        ):
            self.encoder = Encoder(self.tokenizer, self.chat_template, self.name)
            self.conversational = is_messages(first["completion"])
            self.mode = "prompt_completion"
            return self.mode
        return super().detect(first, columns)

    def row_rules(self) -> tuple[ColumnRule, ...]:
        if self.mode != "prompt_completion":
            return super().row_rules()
        # Row by row a string or a chat row passes; Arrow vouches for rows of row 0's kind.
        kind = ("messages",) if self.conversational else ("str",)
        return (
            ColumnRule("completion", kind),
            ColumnRule("prompt", kind, empty_ok=True, null_ok=True),
        )

    def check_row(self, row: Mapping[str, Any], where: Any) -> None:
        if self.mode != "prompt_completion":
            return super().check_row(row, where)
        completion = row.get("completion")
        chat = is_messages(completion)
        check_value(self.name, where, "completion", completion, chat)
        # The encoder tokenizes a string prompt before a string completion, renders a
        # message prompt before chat messages.
        check_prompt(self.name, where, row.get("prompt"), strings=not chat, messages=chat)

    def __call__(self, rows: list[dict[str, Any]], where: Sequence[Any]) -> list[dict[str, Any]]:
        if self.mode is None and rows:
            self.detect(rows[0])
        if self.mode != "prompt_completion":
            return super().__call__(rows, where)
        out = []
        for row, w in zip(rows, where):
            self.check_row(row, w)
            completion = row.get("completion")
            try:
                example = encode_prompt_completion(
                    self.encoder, row.get("prompt"), completion, self.max_length
                )
            except DatasetError as exc:
                raise DatasetError(f"{self.name} row {w}: {exc}") from exc
            if not self.completion_only_loss:
                example["labels"] = example["input_ids"].copy()
            out.append(example)
        return out

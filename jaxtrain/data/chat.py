"""Chat rows: a list of {"role", "content"} messages rendered with the tokenizer's template.

With ``completion_only_loss`` only the assistant turns are learned: every other token gets
label -100. The assistant spans are found as character ranges of the rendered text (the
conversation up to each reply, rendered with ``add_generation_prompt=True``, must be a
prefix of the whole rendering, true of the usual templates) and mapped to tokens through
the fast tokenizer's offsets: every token that overlaps a reply is learned.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.data.errors import DatasetError

__all__ = ["render_chat", "with_chat_template"]


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DatasetError(
            f"expected a non-empty list of {{'role': ..., 'content': ...}} messages, got "
            f"{type(messages).__name__}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise DatasetError(
                f"message {i} must be a dict with 'role' and 'content', got {str(m)[:60]!r}"
            )
        if not isinstance(m["role"], str) or not m["role"]:
            # A file's rows share one schema: a key misspelled in one row ("rol") is a
            # column of its own there, and that row's 'role' reads as null.
            keys = sorted(k for k, v in m.items() if v is not None)
            raise DatasetError(
                f"message {i} has no 'role' (got {m['role']!r}; its keys with values: "
                f"{keys}); give every message a role such as 'user' or 'assistant'"
            )
    return [dict(m) for m in messages]


def with_chat_template(processing_class: Any, chat_template: str | None) -> Any:
    """`processing_class` itself, or a shallow copy whose template is `chat_template`
    (TrainingArguments.chat_template), the caller's tokenizer or processor left as it was:
    for code that reads the template from the tokenizer in many places (GRPO's prompts, tool
    calls and turns) rather than taking it per call as `render_chat` does."""
    if chat_template is None or processing_class is None:
        return processing_class
    templated = copy.copy(processing_class)
    templated.chat_template = chat_template
    return templated


def render_chat(
    tokenizer: Any,
    messages: Any,
    *,
    completion_only_loss: bool = False,
    chat_template: str | None = None,
) -> dict[str, np.ndarray]:
    """``{"input_ids", "labels"}`` of one conversation (int64 arrays)."""
    messages = _check_messages(messages)

    def render(msgs: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(
            msgs,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            chat_template=chat_template,
        )

    text = render(messages)
    encoding = tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=completion_only_loss
    )
    ids = np.asarray(encoding["input_ids"], np.int64)
    if not completion_only_loss:
        return {"input_ids": ids, "labels": ids.copy()}
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError("completion_only_loss needs at least one 'assistant' message")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], generation_prompt=True)
        upto = render(messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(prompt)):
            raise DatasetError(
                "the chat template does not render a conversation's beginning as a prefix of "
                "the whole, so prompt and completion cannot be told apart; use a prefix-stable "
                "chat_template or completion_only_loss=False"
            )
        spans.append((len(prompt), len(upto)))
    offsets = np.asarray(encoding["offset_mapping"], np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    learn = np.zeros(len(ids), bool)
    for lo, hi in spans:
        # A token overlapping the reply is the reply's, as transformers' assistant masks
        # have it: "assistant: " then "2" tokenizes as " 2", which begins in the prompt.
        learn |= (starts < hi) & (ends > lo)
    labels = np.where(learn, ids, IGNORE_INDEX)
    return {"input_ids": ids, "labels": labels}

"""The prompt of the end-of-run sample, in the run's own data format.

`jaxtrain train` ends with a sample. A prompt the user set (`sample.prompt`) wins; otherwise
it is taken from the run's data, so a chat fine-tune is sampled through its chat template
and a code or prose model continues the beginning of a real held-out row, never a prompt
written for another dataset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxtrain.data.mixture import Source
from jaxtrain.errors import ArgumentError

# A continuation prompt is the first half of a row, at most this many tokens.
MAX_PROMPT_TOKENS = 32


def first_row(dataset: Any) -> Mapping[str, Any] | None:
    """Row 0 of a map-style dataset, or the first row of a stream; None when empty. A
    mixture ({name: source}) gives its first source's."""
    if isinstance(dataset, Mapping):
        dataset = next(iter(dataset.values()), None)
    if isinstance(dataset, Source):
        dataset = dataset.data
    if dataset is None:
        return None
    try:
        if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            return dataset[0] if len(dataset) else None
        return next(iter(dataset), None)
    except (IndexError, StopIteration):
        return None


def sample_prompt(
    tokenizer: Any,
    dataset: Any,
    *,
    prompt: str | None = None,
    messages_column: str = "messages",
    text_column: str = "text",
    chat_template: str | None = None,
    tools: Any = None,
) -> tuple[list[int], str]:
    """-> (prompt token ids, the prompt as text) for the end-of-run sample.

    Order: `prompt` if given; a row's own `prompt` (DPO/reward pairs, prompt+completion);
    chat rows: the conversation up to its last assistant reply,
    rendered with the chat template and its generation prompt; token or text rows: the first
    half (at most MAX_PROMPT_TOKENS tokens) of the first row. `tools(row)`: the tools a chat
    prompt shows (a tools run's, as its rollouts' prompts showed them).
    """
    if prompt is not None:
        ids = list(tokenizer(prompt)["input_ids"])
        return ids or [tokenizer.eos_token_id], prompt
    row = first_row(dataset) or {}
    messages = row.get(messages_column)
    if isinstance(row.get("prompt"), str):  # preference and prompt/completion rows
        return sample_prompt(tokenizer, None, prompt=row["prompt"])
    if isinstance(row.get("prompt"), list | tuple) and row["prompt"]:
        messages = row["prompt"]  # a conversational prompt
    if isinstance(messages, list | tuple) and messages:
        turns = [dict(m) for m in messages]
        while turns and turns[-1].get("role") == "assistant":
            turns.pop()  # the model writes the reply
        text = tokenizer.apply_chat_template(
            turns or [dict(messages[0])],
            tools=tools(row) if tools is not None else None,  # a tools run's: `shown(row)`
            tokenize=False,
            add_generation_prompt=True,
            chat_template=chat_template,
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text
    ids = row.get("input_ids")
    if ids is None and isinstance(row.get(text_column), str):
        ids = tokenizer(row[text_column])["input_ids"]
    if ids is not None:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        ids = ids[: max(1, min(len(ids) // 2, MAX_PROMPT_TOKENS))]
        return ids, tokenizer.decode(ids)
    eos = tokenizer.eos_token_id
    return ([eos] if eos is not None else [0]), ""


def vision_sample_prompt(
    processor: Any,
    dataset: Any,
    *,
    prompt: str | None = None,
    image: str | None = None,
    messages_column: str = "messages",
    chat_template: str | None = None,
) -> tuple[list[int], str, np.ndarray | None]:
    """-> (prompt token ids, the prompt as text, its images [n, C, H, W] or None) of a
    vision-language model's sample: the user's `prompt` about `image` (a path) as one user
    turn; else the first row's conversation up to its last reply (or its `prompt`: preference
    and prompt+completion rows), with the row's images."""
    from jaxtrain.data.images import images_of, load_image, place_images
    from jaxtrain.data.vision import processed_prompt

    if prompt is not None or image is not None:
        turn = [{"role": "user", "content": prompt or ""}]
        images = [] if image is None else [load_image(image, "sample.image")]
        messages = place_images(turn, len(images), "sample.prompt")
    else:
        row = first_row(dataset) or {}
        turns = row.get(messages_column) or row.get("prompt") or []
        if isinstance(turns, str):  # preference and prompt+completion rows: a plain prompt
            turns = [{"role": "user", "content": turns}]
        turns = [dict(m) for m in turns]
        while turns and turns[-1].get("role") == "assistant":
            turns.pop()  # the model writes the reply
        if not turns:
            raise ArgumentError(
                f"the data's first row has no {messages_column!r} or 'prompt' to sample from; "
                "give sample.prompt (and sample.image), e.g. --prompt TEXT --image PATH"
            )
        images = [load_image(i, "the data's row 0") for i in images_of(row, "the data's row 0")]
        messages = place_images(turns, len(images), "the data's row 0")
    ids, pixels, text = processed_prompt(processor, messages, images, chat_template=chat_template)
    return ids, text, pixels

"""Which prompts each GRPO step trains on: a pure function of the seed and the step (so a
resumed run regenerates from the same prompts), with the position a checkpoint keeps."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxtrain.data.errors import DatasetError
from jaxtrain.data.images import (
    IMAGE_COLUMNS,
    images_of,
    load_image,
    place_images,
    refuse_unread_images,
)
from jaxtrain.data.packing import ImageSlots
from jaxtrain.data.units import epoch_order
from jaxtrain.data.vision import is_processor, processed_prompt, text_tokenizer
from jaxtrain.errors import ArgumentError

__all__ = ["PromptLoader", "Prompts", "chat_ids", "observed_prompt", "read_prompts"]

logger = logging.getLogger("jaxtrain.trainers.grpo")
PROMPT_ID_COLUMNS = ("prompt_ids", "input_ids")


class Prompts:
    """The tokenized prompts (left-truncated ids), what reward functions receive as
    `prompts` (text or messages), the dataset's other columns (passed to them too), and the
    share of prompts whose start was cut."""

    def __init__(
        self,
        ids: list[np.ndarray],
        values: list[Any],
        columns: dict[str, list],
        truncated_share: float = 0.0,
        column: str = "prompt",
        images: list[np.ndarray | None] | None = None,
    ):
        self.ids, self.values, self.columns = ids, values, columns
        self.truncated_share, self.column = truncated_share, column
        # A vision-language model's prompts: each one's images' pixels [n, C, H, W] or None.
        self.images = images

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def image_shape(self) -> tuple[int, ...] | None:
        """(C, H, W) of the prompts' images (a vision-language model's), else None."""
        first = next((x for x in self.images or [] if x is not None), None)
        return None if first is None else tuple(first.shape[1:])

    def image_slots(self, rows: np.ndarray, per_row: int) -> np.ndarray:
        """[len(rows), per_row, C, H, W]: the images of prompts[rows], each row's slots."""
        slots = ImageSlots(per_row, self.image_shape)
        return np.stack([slots.row([] if self.images[r] is None else [self.images[r]])
                         for r in rows])  # fmt: skip

    def row(self, index: int) -> dict[str, Any]:
        """Row `index` of the dataset, as an environment's reset(**row) receives it."""
        return {self.column: self.values[index], **{k: v[index] for k, v in self.columns.items()}}


def chat_ids(tokenizer: Any, messages: list, tools: list | None = None) -> list[int]:
    """A chat prompt's tokens: the template's text (showing `tools`) ready for the answer."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=True, tokenize=False
    )
    return text_tokenizer(tokenizer)(text, add_special_tokens=False)["input_ids"]


def observed_prompt(messages: list, observation: str) -> list:
    """The prompt with an environment's observation after its last message's text (TRL's)."""
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"] + observation}]


def read_prompts(dataset: Any, tokenizer: Any, limit: int, tools: Any = None) -> Prompts:
    """Every prompt tokenized (left-truncated to `limit` tokens, with a warning giving the
    share), what reward functions receive as `prompts`, and the other columns. Chat prompts
    show the model `tools` (their schemas, as the chat template writes them), or
    `tools(row, index)`, a row's own."""
    rows = _rows(dataset)
    if not rows:
        raise DatasetError("dataset_train is empty; pass at least one prompt row")
    names = list(rows[0])
    if "prompt" in names and not isinstance(rows[0]["prompt"], (list, tuple)):
        kind, used = "text", ["prompt"]
    elif "prompt" in names or "messages" in names:
        kind, used = "chat", ["prompt" if "prompt" in names else "messages"]
    elif any(c in names for c in PROMPT_ID_COLUMNS):
        kind, used = "ids", [next(c for c in PROMPT_ID_COLUMNS if c in names)]
    else:
        raise DatasetError(
            f"dataset_train has columns {names}; GRPO prompts are a `prompt` text column, "
            "chat `messages` (or a `prompt` list of messages), or token ids (`prompt_ids`)"
        )
    vision = is_processor(tokenizer) and any(c in names for c in IMAGE_COLUMNS)
    if not vision:
        refuse_unread_images(rows[0], "dataset_train", tokenizer)
    if vision and (kind != "chat" or tools):
        raise DatasetError(
            "GRPO prompts with images are chat prompts (a `prompt` or `messages` list of "
            f"messages) without tools; this dataset's prompts are {kind}"
            + (" with tools" if tools else "")
        )
    if kind == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"dataset_train's `{used[0]}` holds chat messages but the tokenizer has no "
            "chat_template; set TrainingArguments.chat_template (--chat_template) to a Jinja "
            "template, or use a tokenizer that has one"
        )
    if tools and kind != "chat":
        raise DatasetError(
            f"GRPO with tools needs chat prompts (a `prompt` or `messages` list of messages): "
            f"the tools are shown to the model through the chat template; this dataset's "
            f"prompts are {kind}"
        )
    ids, shown, cut, images = [], [], 0, []
    text_side = text_tokenizer(tokenizer)
    for i, row in enumerate(rows):
        value = row[used[0]]
        if value is None:  # a null in a file's column: the tokenizer's error names no row
            raise DatasetError(
                f"dataset_train row {i}: column {used[0]!r} is null; give every row its prompt, "
                "or drop that row"
            )
        if vision:  # the processor renders the chat and expands each image into its tokens
            tokens, pixels = image_prompt(tokenizer, row, value, i)
            if len(tokens) > limit and pixels is not None:
                raise DatasetError(
                    f"dataset_train row {i}: the prompt has {len(tokens)} tokens with its "
                    f"images, more than max_prompt_length={limit}, and its start (an image's "
                    "tokens) cannot be cut; raise max_prompt_length or shorten the prompt"
                )
            images.append(pixels)
            text = value
        elif kind == "text":
            tokens, text = text_side(value, add_special_tokens=True)["input_ids"], value
        elif kind == "chat":
            tokens = chat_ids(tokenizer, value, tools(row, i) if callable(tools) else tools)
            text = value  # reward functions get the messages, as TRL passes them
        else:
            tokens, text = list(value), text_side.decode(list(value))
        if not len(tokens):
            raise DatasetError(f"dataset_train row {i}: the prompt is empty")
        cut += len(tokens) > limit
        ids.append(np.asarray(tokens[-limit:], np.int32))  # the end is what is answered
        shown.append(text)
    if cut:
        logger.warning(
            "GRPO: %d of %d prompts (%.1f%%) are longer than max_prompt_length=%d; their "
            "start is cut. Raise max_prompt_length to keep them whole.",
            cut, len(rows), 100 * cut / len(rows), limit,
        )  # fmt: skip
    columns = {c: [r[c] for r in rows] for c in names if c not in used}
    return Prompts(ids, shown, columns, truncated_share=cut / len(rows), column=used[0],
                   images=images if vision else None)  # fmt: skip


def image_prompt(processor: Any, row: dict[str, Any], messages: list, index: int):
    """(token ids, images' pixels [n, C, H, W] or None) of a chat prompt with the row's
    images, rendered by a vision-language model's processor ready for the answer."""
    where = f"dataset_train row {index}"
    images = [load_image(x, where) for x in images_of(row, where)]
    placed = place_images([dict(m) for m in messages], len(images), where)
    ids, pixels, _ = processed_prompt(processor, placed, images)
    return ids, pixels


def _rows(dataset: Any) -> list[dict[str, Any]]:
    """Row dicts of a datasets.Dataset, a dict of columns or a list of rows."""
    if isinstance(dataset, dict):
        names = list(dataset)
        return [dict(zip(names, values)) for values in zip(*dataset.values())]
    if hasattr(dataset, "column_names") and isinstance(dataset.column_names, dict):
        raise ArgumentError("pass one split (dataset['train']), not a DatasetDict")
    return [dict(r) for r in dataset]


class PromptLoader:
    """Which dataset rows are the prompts of each step: a shuffled epoch order (seed, epoch),
    one round of `prompts` rows per num_iterations steps."""

    def __init__(
        self,
        num_rows: int,
        prompts: int,
        num_iterations: int,
        seed: int,
        shuffle: bool,
        group: int = 1,
        accumulation: int = 1,
    ):
        if num_rows < prompts:
            raise DatasetError(
                f"dataset_train has {num_rows} prompts but one update needs {prompts} "
                "(total_batch_size / num_generations); lower total_batch_size or add prompts"
            )
        self.num_rows, self.prompts, self.num_iterations = num_rows, prompts, num_iterations
        self.seed, self.shuffle = seed, shuffle
        self.group, self.accumulation = group, accumulation
        self.rounds_per_epoch = num_rows // prompts

    @property
    def steps_per_epoch(self) -> int:
        return self.rounds_per_epoch * self.num_iterations

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch

    def rows_at(self, step: int) -> np.ndarray:
        epoch, within = divmod(step // self.num_iterations, self.rounds_per_epoch)
        order = epoch_order(self.num_rows, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return order[within * self.prompts : (within + 1) * self.prompts].astype(np.int32)

    def refill_rows(self, step: int, attempt: int, count: int, exclude: np.ndarray) -> np.ndarray:
        """Up to `count` other rows for dynamic sampling's `attempt`-th pass of `step`'s round:
        a pure function of the seed, the round and the pass (a resumed run draws the same),
        none of `exclude` (the round's prompts so far)."""
        key = [self.seed, 0x5EED, step // self.num_iterations, attempt]
        order = np.random.default_rng(key).permutation(self.num_rows)
        return order[~np.isin(order, exclude)][:count].astype(np.int32)

    def data_state(self, step: int) -> dict[str, Any]:
        return {"kind": "grpo_prompts", "step": int(step), "seed": self.seed,
                "num_rows": self.num_rows, "prompts": self.prompts}  # fmt: skip

    def check_data_state(self, state: dict[str, Any]) -> int:
        mine = self.data_state(state.get("step", 0))
        changed = [k for k in mine if k != "step" and state.get(k) != mine[k]]
        if changed:
            raise DatasetError(
                f"the checkpoint's prompt order differs in {changed} (saved {state}, now "
                f"{mine}); resume with the same dataset, seed and batch sizes"
            )
        return int(state["step"])

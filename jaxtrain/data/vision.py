"""Rows with images -> token examples with their pixels, through a Hugging Face processor.

Rows: ``messages`` (or ``prompt`` + ``completion``, strings or messages, or ``text`` holding the
processor's image placeholders) with ``images`` / ``image`` (data/images.py). The processor
(``AutoProcessor``: its chat template, tokenizer and image processor, numpy/PIL path) renders
and tokenizes a row and expands each image's placeholder into the image's tokens.

- **Labels**: as SFT on text (the assistant turns / the completion with
  ``completion_only_loss``, else the whole row), and never an image's own tokens: they are
  inputs the vision tower fills in, not text to predict. The row is rendered once, cut where
  the learned spans begin and end (the conversation up to a reply must render as a prefix of
  the whole) and each piece is processed with its own images; the pieces' text tokens must
  join into the whole's, or the row is an error.
- **Truncation** (``max_length``) never cuts an image: a row whose cut would remove any of an
  image's tokens is an error naming the row (``image_truncation="error"``) or is dropped
  (``"drop"``: it becomes an empty row that carries no loss; drops are counted and logged).
- **Batches** (``VisionCollator``): tokens right-padded to ``seq_len``; ``pixel_values``
  [rows, images_per_row, C, H, W], each row's images in the order of their placeholders, the
  empty slots zero (the model reads a row's k-th image for its k-th image placeholder).
  Packed (data/packing.py), a row holds documents while their tokens fit ``seq_len`` and their
  images its ``images_per_row`` slots; each document keeps its segment, so an image's tokens
  attend within their own document only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.config.tables import IMAGE_TRUNCATION
from jaxtrain.data.collate import IGNORE_INDEX, TRUNCATED_TOKENS, collate_examples, masked_positions
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.images import images_of, load_image, place_images
from jaxtrain.data.packing import ImageSlots
from jaxtrain.errors import ArgumentError

__all__ = [
    "VisionCollator",
    "check_image_model",
    "processed_prompt",
    "VisionFeaturizer",
    "is_processor",
    "text_tokenizer",
]

logger = logging.getLogger("jaxtrain.data")

Piece = tuple[str, bool]  # (rendered text, learned)


def is_processor(processing_class: Any) -> bool:
    """Whether `processing_class` is a multimodal processor (it has an image processor)."""
    return getattr(processing_class, "image_processor", None) is not None


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of a processor, or `processing_class` itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def check_image_model(processor: Any, config: Any) -> None:
    """ArgumentError unless the model of `config` takes the images `processor` makes."""
    if getattr(config, "image_token_id", None) is None:
        raise ArgumentError(
            f"processing_class is a multimodal processor ({type(processor).__name__}) but the "
            f"model ({type(config).__name__}) takes no images; pass its tokenizer "
            "(processor.tokenizer) or a vision-language model."
        )
    if getattr(config, "image_shape", None) is None:  # a tower of any image size (Qwen2.5-VL)
        raise ArgumentError(
            f"training on image rows needs a vision tower of fixed-size images (Gemma 3's); "
            f"{type(config).__name__}'s images keep their sizes, which the data pipeline does "
            "not batch yet (docs/models.md). Train it on text rows, or use a Gemma 3 model."
        )


def processed_prompt(
    processor: Any, messages: list, images: list, *, tools: Any = None, chat_template: Any = None
) -> tuple[list[int], np.ndarray | None, str]:
    """(token ids, the images' pixels [n, C, H, W] or None, the rendered text) of a chat ready
    for the answer: `messages` with their image parts, rendered and tokenized by the
    processor, each image expanded into its tokens."""
    text = processor.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False,
        chat_template=chat_template,
    )  # fmt: skip
    out = processor(
        text=[text], images=[images] if images else None, return_tensors="np",
        add_special_tokens=False,
    )  # fmt: skip
    pixels = np.asarray(out["pixel_values"], np.float32) if images else None
    return [int(t) for t in out["input_ids"][0]], pixels, text


class VisionFeaturizer(Featurizer):
    """Image rows -> ``{"input_ids", "labels", "pixel_values" [n, C, H, W]}`` (module docstring)."""

    takes_images = True

    def __init__(
        self,
        *,
        name: str,
        processor: Any,
        image_token_id: int,
        image_shape: tuple[int, int, int],
        max_length: int,
        images_per_row: int = 1,
        image_truncation: str = "error",
        truncation_mode: str = "keep_start",
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name, tokenizer=processor, **kwargs)
        if image_truncation not in IMAGE_TRUNCATION:
            raise ValueError(
                f"image_truncation={image_truncation!r} is not one of {IMAGE_TRUNCATION}"
            )
        self.processor, self.image_token_id = processor, image_token_id
        self.image_shape = tuple(image_shape)
        self.max_length, self.images_per_row = max_length, images_per_row
        self.image_truncation, self.truncation_mode = image_truncation, truncation_mode
        self.placeholder = processor.image_token  # what the chat template writes per image
        self.dropped_rows = 0

    @property
    def collator(self) -> VisionCollator:
        """How this featurizer's examples become batches."""
        return VisionCollator(
            seq_len=self.max_length,
            pad_token_id=self.pad_token_id,
            image_slots=ImageSlots(self.images_per_row, self.image_shape),
        )

    @property
    def pad_token_id(self) -> int:
        tokenizer = text_tokenizer(self.processor)
        pad = tokenizer.pad_token_id
        return int(tokenizer.eos_token_id if pad is None else pad)

    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        if not isinstance(first, Mapping):
            raise DatasetError(f"{self.name} row 0 is a {type(first).__name__}, expected a dict")
        row = self.drop(dict(first))
        if self.messages_column in row:
            self.mode = "messages"
        elif "prompt" in row and "completion" in row:
            self.mode = "prompt_completion"
        elif self.text_column in row:
            self.mode = "text"
        else:
            raise DatasetError(
                f"{self.name} has neither {self.messages_column!r}, 'prompt' + 'completion' nor "
                f"{self.text_column!r} beside its images; available columns: {sorted(row)}"
            )
        if self.mode != "text" and self.chat_template is None and not self._has_template():
            raise DatasetError(
                f"{self.name}: the processor has no chat template to render {self.mode} rows "
                "with; set chat_template or use a processor that has one"
            )
        return self.mode

    def row_rules(self) -> tuple:
        return ()  # its rows (text beside images) are checked as read, by its own rules

    def _has_template(self) -> bool:
        return bool(getattr(self.processor, "chat_template", None))

    def __call__(self, rows: list[dict[str, Any]], where: Sequence[Any]) -> list[dict[str, Any]]:
        if self.mode is None and rows:
            self.detect(rows[0])
        out = []
        for row, w in zip(rows, where):
            label = f"{self.name} row {w}"
            example = self.example(self.drop(dict(row)), label)
            self.check_tokens(example, w)
            out.append(example)
        return out

    # ------------------------------------------------------------------ one row
    def example(self, row: dict[str, Any], where: str) -> dict[str, Any]:
        images = [load_image(image, where) for image in images_of(row, where)]
        if len(images) > self.images_per_row:
            raise DatasetError(
                f"{where} has {len(images)} images but images_per_row={self.images_per_row}; "
                f"raise images_per_row to at least {len(images)}"
            )
        pieces = self._pieces(row, len(images), where)
        ids, labels, pixels = self._process(pieces, images, where)
        labels[ids == self.image_token_id] = IGNORE_INDEX
        return self._truncate(ids, labels, pixels, where)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=self.chat_template,
        )  # fmt: skip

    def _pieces(self, row: dict[str, Any], count: int, where: str) -> list[Piece]:
        if self.mode == "text":
            text = row.get(self.text_column)
            if not isinstance(text, str):
                raise DatasetError(f"{where}: column {self.text_column!r} must be a string")
            return [(text, True)]
        if self.mode == "prompt_completion":
            return self._prompt_completion(row, count, where)
        messages = row.get(self.messages_column)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise DatasetError(f"{where}: column {self.messages_column!r} must be a message list")
        messages = place_images([dict(m) for m in messages], count, where)
        text = self._render(messages)
        if not self.completion_only_loss:
            return [(text, True)]
        cuts = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt, upto = self._render(messages[:i], True), self._render(messages[: i + 1])
            if not (text.startswith(upto) and upto.startswith(prompt)):
                raise DatasetError(
                    f"{where}: the chat template does not render a conversation's beginning as "
                    "a prefix of the whole, so the replies cannot be told apart; use a "
                    "prefix-stable chat_template or completion_only_loss=False"
                )
            cuts.append((len(prompt), len(upto)))
        if not cuts:
            raise DatasetError(f"{where}: completion_only_loss needs an 'assistant' message")
        return _split(text, cuts)

    def _prompt_completion(self, row: dict[str, Any], count: int, where: str) -> list[Piece]:
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            eos = text_tokenizer(self.processor).eos_token or ""
            return [(prompt, not self.completion_only_loss), (completion + eos, True)]
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise DatasetError(
                f"{where}: 'prompt' and 'completion' must both be strings or both message lists"
            )
        prompt_messages = place_images([dict(m) for m in prompt], count, where)
        completion_messages = [{**m, "content": m["content"]} for m in completion]
        head = self._render(prompt_messages, True)
        text = self._render(prompt_messages + place_images(completion_messages, 0, where))
        if not text.startswith(head):
            raise DatasetError(
                f"{where}: the chat template does not render the prompt as a prefix of prompt + "
                "completion; use a prefix-stable chat_template"
            )
        return [(head, not self.completion_only_loss), (text[len(head) :], True)]

    def _process(
        self, pieces: list[Piece], images: list[Any], where: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = [text.count(self.placeholder) for text, _ in pieces]
        if sum(counts) != len(images):
            raise DatasetError(
                f"{where}: the rendered text holds {sum(counts)} image placeholder(s) "
                f"{self.placeholder!r} for {len(images)} image(s)"
            )
        tokenizer = text_tokenizer(self.processor)
        whole = tokenizer("".join(t for t, _ in pieces), add_special_tokens=False)["input_ids"]
        joined = [i for t, _ in pieces for i in tokenizer(t, add_special_tokens=False)["input_ids"]]
        if list(whole) != joined:
            raise DatasetError(
                f"{where}: the text of the replies tokenizes differently alone than inside the "
                "conversation, so their tokens cannot be found; use completion_only_loss=False"
            )
        ids, labels, pixels, at = [], [], [], 0
        for (text, learned), count in zip(pieces, counts):
            mine = images[at : at + count]
            at += count
            if not text:
                continue
            try:
                out = self.processor(
                    text=[text], images=[mine] if mine else None, return_tensors="np",
                    add_special_tokens=False,
                )  # fmt: skip
            except Exception as exc:  # the processor raises many types for a bad row
                raise DatasetError(f"{where}: the processor failed: {exc}") from exc
            piece = np.asarray(out["input_ids"][0], np.int64)
            ids.append(piece)
            labels.append(piece.copy() if learned else np.full_like(piece, IGNORE_INDEX))
            if mine:
                pixels.append(np.asarray(out["pixel_values"], np.float32))
        pixel_values = np.concatenate(pixels) if pixels else np.zeros((0, *self.image_shape))
        if pixel_values.shape[1:] != self.image_shape:
            raise DatasetError(
                f"{where}: the processor made images of shape {pixel_values.shape[1:]} but the "
                f"model's vision tower takes {self.image_shape}; use the model's own processor"
            )
        return np.concatenate(ids), np.concatenate(labels), pixel_values.astype(np.float32)

    def _truncate(
        self, ids: np.ndarray, labels: np.ndarray, pixels: np.ndarray, where: str
    ) -> dict[str, Any]:
        n, limit = len(ids), self.max_length
        if n > limit:
            keep = slice(0, limit) if self.truncation_mode == "keep_start" else slice(n - limit, n)
            cut_images = (ids == self.image_token_id).sum() - (
                ids[keep] == self.image_token_id
            ).sum()
            if cut_images:
                return self._cut_image(n, where)
            ids, labels = ids[keep], labels[keep]
        cut = n - len(ids)  # counted as the batch's truncated tokens
        return {"input_ids": ids, "labels": labels, "pixel_values": pixels, TRUNCATED_TOKENS: cut}

    def _cut_image(self, length: int, where: str) -> dict[str, Any]:
        message = (
            f"{where} has {length} tokens: truncating it to max_sequence_length="
            f"{self.max_length} would cut an image's tokens"
        )
        if self.image_truncation == "error":
            raise DatasetError(
                f"{message}; raise max_sequence_length, shorten the row, or set "
                "image_truncation='drop' to skip such rows"
            )
        self.dropped_rows += 1
        if self.dropped_rows & (self.dropped_rows - 1) == 0:  # 1, 2, 4, 8, ...
            logger.warning(
                "%s; dropped (image_truncation='drop'). %s: %d row(s) dropped so far.",
                message, self.name, self.dropped_rows,
            )  # fmt: skip
        empty = np.zeros(0, np.int64)
        return {
            "input_ids": empty,
            "labels": empty,
            "pixel_values": np.zeros((0, *self.image_shape)),
        }


def _split(text: str, spans: list[tuple[int, int]]) -> list[Piece]:
    """`text` cut into pieces, learned inside `spans` (sorted character ranges)."""
    pieces, at = [], 0
    for lo, hi in spans:
        pieces += [(text[at:lo], False), (text[lo:hi], True)]
        at = hi
    return [*pieces, (text[at:], False)]


class VisionCollator:
    """Examples of a VisionFeaturizer -> token rows [N, seq_len] and ``pixel_values``
    [N, images_per_row, C, H, W] (see the module docstring). Packed, the Packer fills each
    row's ``image_slots`` with the images of the documents it holds (data/packing.py)."""

    def __init__(self, *, seq_len: int, pad_token_id: int, image_slots: ImageSlots) -> None:
        self.seq_len, self.pad_token_id, self.image_slots = seq_len, pad_token_id, image_slots

    padding_tokens = staticmethod(masked_positions)  # the meter's count (data/assemble.py)

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        batch = collate_examples(
            examples, seq_len=self.seq_len, pad_token_id=self.pad_token_id,
            truncation_mode="keep_start",
        )  # fmt: skip
        rows = [self.image_slots.row([e.get("pixel_values", [])]) for e in examples]
        batch["pixel_values"] = np.stack(rows)
        return batch

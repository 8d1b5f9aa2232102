"""The images of a vision row, and the messages they belong to (TRL's vision format).

A row holds ``images`` (a list) or ``image`` (one), each a PIL image, a path, raw bytes, or the
``{"bytes", "path"}`` dict a ``datasets.Image`` column stores. Its ``messages`` either place
the images themselves (``{"type": "image"}`` parts in a turn's content, in order) or hold plain
strings, and then the images open the first user turn, as TRL places them.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxtrain.data.errors import DatasetError

__all__ = ["IMAGE_COLUMNS", "images_of", "load_image", "place_images", "refuse_unread_images"]

IMAGE_COLUMNS = ("images", "image")


def images_of(row: Mapping[str, Any], where: str) -> list[Any]:
    """The row's images (unloaded), [] when it has none."""
    if "images" in row:
        images = row["images"]
        if images is None:
            return []
        if not isinstance(images, (list, tuple)):
            raise DatasetError(
                f"{where}: column 'images' must be a list of images, got "
                f"{type(images).__name__}; put a single image in an 'image' column instead"
            )
        return list(images)
    image = row.get("image")
    return [] if image is None else [image]


def refuse_unread_images(row: Mapping[str, Any], name: str, processing_class: Any) -> None:
    """DatasetError when `name`'s first row holds images that a text tokenizer would drop:
    the model would train on the text alone and never see a picture."""
    if not images_of(row, f"{name} row 0"):
        return
    kind = type(processing_class).__name__
    if getattr(processing_class, "image_processor", None) is not None:
        why = f"this task reads text rows only (the processor {kind} is given)"
        fix = "use a task that takes images (sft, dpo, orpo, cpo, grpo, rloo)"
    else:
        why = f"the processing class ({kind}) is a text tokenizer"
        fix = (
            "give a vision-language model with its processor (a model directory with "
            "preprocessor_config.json, or processing_class=AutoProcessor.from_pretrained(...))"
        )
    raise DatasetError(
        f"{name} row 0 has images, but {why}: the images would be dropped and the model would "
        f"train on the text alone. {fix[0].upper() + fix[1:]}, or drop the images "
        "(ids_to_pop_from_dataset=['images'], --ids_to_pop_from_dataset images)"
    )


def load_image(value: Any, where: str) -> Any:
    """A PIL image in RGB from any of the module's forms."""
    from PIL import Image

    if isinstance(value, Mapping):  # datasets.Image storage
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            path = Path(value).expanduser()
            if not path.is_file():
                raise DatasetError(
                    f"{where}: image file {str(path)!r} does not exist (relative paths are read "
                    "from the directory jaxtrain runs in)"
                )
            image = Image.open(path)
        else:
            raise DatasetError(
                f"{where}: an image must be a PIL image, a file path, bytes or a "
                f"{{'bytes', 'path'}} dict, got {type(value).__name__}"
            )
        return image.convert("RGB")
    except DatasetError:
        raise
    except Exception as exc:  # PIL raises several types for a file that is not an image
        raise DatasetError(f"{where}: the image cannot be read: {exc}") from exc


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [dict(part) for part in content]


def place_images(messages: list[dict[str, Any]], count: int, where: str) -> list[dict[str, Any]]:
    """Messages whose contents are lists of parts with exactly `count` image parts: the row's
    own, or (plain-string messages) `count` image parts opening the first user turn."""
    placed = [{**m, "content": _parts(m["content"])} for m in messages]
    own = sum(p.get("type") == "image" for m in placed for p in m["content"])
    if own == 0 and count:
        users = [m for m in placed if m["role"] == "user"]
        if not users:
            raise DatasetError(f"{where}: the row has images but no user turn to hold them")
        users[0]["content"] = [{"type": "image"}] * count + users[0]["content"]
        own = count
    if own != count:
        raise DatasetError(
            f"{where}: the messages have {own} image part(s) but the row has {count} image(s); "
            "give one image per {'type': 'image'} part"
        )
    return placed

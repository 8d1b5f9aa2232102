"""Images in OpenAI chat requests: `{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}` parts of a message's content, for a vision-language model's processor.

Only data URLs are read: the server downloads nothing (a URL it would fetch is a request to
reach any address its host can). The parts become the `{"type": "image"}` placeholders chat
templates render, and the processor (its chat template, tokenizer and image processor) gives
the prompt's ids, each image expanded into its tokens, and the images' pixels for the engine.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np

from jaxtrain.data.vision import processed_prompt

__all__ = ["image_prompt"]


def _parts(messages: list[Any]) -> list[tuple[int, dict[str, Any]]]:
    return [
        (i, part)
        for i, message in enumerate(messages)
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def _image(part: dict[str, Any], where: str, error: type) -> Any:
    from PIL import Image

    url = (
        (part.get("image_url") or {}).get("url")
        if isinstance(part.get("image_url"), dict)
        else None
    )
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise error(
            400, f"{where}: image_url.url must be a data URL (data:image/png;base64,...); this "
            "server fetches no URLs", "messages",
        )  # fmt: skip
    try:
        data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
        return Image.open(io.BytesIO(data)).convert("RGB")
    except (binascii.Error, ValueError, OSError) as err:
        raise error(400, f"{where}: the image cannot be read: {err}", "messages") from None


def image_prompt(
    processor: Any, messages: list[Any], tools: Any, error: type
) -> tuple[list[int], np.ndarray | None]:
    """(the prompt's ids, its images' pixels [n, C, H, W] or None) of a chat request for a
    vision-language model's `processor`; `error(status, message, param)` for a bad part."""
    images, rendered = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                images.append(_image(part, f"messages[{i}]", error))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    try:
        ids, pixels, _ = processed_prompt(processor, rendered, images, tools=tools)
    except Exception as err:  # a malformed message, an image the processor refuses
        raise error(400, f"the messages cannot be rendered: {err}", "messages") from None
    return ids, pixels

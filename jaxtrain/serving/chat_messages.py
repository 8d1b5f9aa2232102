"""A chat request's messages, checked and put in the form chat templates read.

OpenAI's API takes a message's content as a string or as a list of parts, and current
clients (the `openai` SDK's typed messages, agent frameworks) send `[{"type": "text", "text":
...}]` for plain text too. A text model's chat template expects a string: the text parts are
joined with newlines, as vLLM joins them. Image parts are for a vision-language model's
processor (image_parts.py); a text model refuses them, and any part type it cannot read.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ROLES", "checked_messages"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def checked_messages(messages: list[Any], *, text_only: bool, error: type) -> list[Any]:
    """`messages` with each one checked (an object with a known role; content a string, a list
    of parts or null) and, for a text model (`text_only`), its text parts joined into a string;
    `error(400, message, "messages")` names the first message that is wrong."""
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise error(400, f"{where} must be an object with 'role' and 'content'", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise error(
                400, f"{where}: 'role' is {role!r}; use one of {', '.join(ROLES)}", "messages"
            )
        content = message.get("content")
        if isinstance(content, list):
            if text_only:
                message = {**message, "content": _text_of(content, where, error)}
        elif content is not None and not isinstance(content, str):
            raise error(400, f"{where}: 'content' must be a string or a list of parts", "messages")
        out.append(message)
    return out


def _text_of(parts: list[Any], where: str, error: type) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url":
            raise error(400, "this model takes no images (image_url parts)", "messages")
        else:
            raise error(
                400,
                f"{where}.content[{j}]: a text model reads parts {{'type': 'text', 'text': "
                f"...}}, not {kind!r}",
                "messages",
            )
    return "\n".join(texts)

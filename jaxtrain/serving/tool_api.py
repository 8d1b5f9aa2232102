"""Tools in OpenAI's chat API: a request's `tools` and `tool_choice`, the conversation's tool
calls and tool answers for the chat template, and a sample's tool calls in the response.

The model sees the tools through its chat template; its calls are read from the sampled
tokens (tool_chat.parse_turn, the template's format) and come back as `tool_calls`, with
finish_reason "tool_calls"; a turn that calls a function the request did not offer is text.
`tool_choice` "auto" (the default with tools) or "none" (the tools are not shown); "required"
or a named function would need decoding constrained to a call, which this server does not
do: refused with a 400.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxtrain.errors import ArgumentError
from jaxtrain.serving.tool_chat import parse_turn, response_template

__all__ = ["ToolRequest", "read_tools", "template_messages", "tool_message"]


class ToolRequest:
    """The tools a chat request shows the model (their JSON schemas) and how its calls are
    read (the tokenizer's response template)."""

    def __init__(self, tools: list[dict[str, Any]], template: dict[str, Any]):
        self.tools, self.template = tools, template


def read_tools(body: dict[str, Any], tokenizer: Any, error: type) -> ToolRequest | None:
    """The request's tools, checked (None: no tools, or tool_choice "none"); `error(status,
    message, param)` is raised for a malformed field."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools is None:
        if choice not in ("auto", "none"):
            raise error(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise error(400, "'tools' must be a non-empty list of functions", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise error(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                "'parameters': {JSON schema}}}",
                "tools",
            )
    if choice == "none":
        return None
    if choice != "auto":
        raise error(
            400,
            f"tool_choice {choice!r} is not supported: this server does not constrain decoding "
            "to a call; use 'auto' (the model decides) or 'none'",
            "tool_choice",
        )
    try:
        template = response_template(tokenizer)
    except ArgumentError as err:
        raise error(400, f"this model cannot take tools: {err}", "tools") from None
    return ToolRequest(tools, template)


def template_messages(messages: list[Any], error: type) -> list[Any]:
    """The conversation as chat templates read it: an assistant's tool calls carry their
    arguments as objects (OpenAI sends JSON strings)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        parsed = []
        for call in calls:
            function = dict(call.get("function") or {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments or "{}")
                except ValueError:
                    raise error(
                        400,
                        f"messages[{i}]: a tool call's arguments are not JSON: {arguments!r}",
                        "messages",
                    ) from None
            parsed.append({**call, "function": function})
        out.append({**message, "tool_calls": parsed})
    return out


def tool_message(
    tools: ToolRequest, tokenizer: Any, token_ids: list[int], prompt_ids: list[int]
) -> tuple[dict[str, Any], bool]:
    """A sample's assistant message in OpenAI's shape (its tool calls with ids and JSON
    arguments), and whether it called a tool."""
    turn = parse_turn(tokenizer, tools.template, token_ids, prompt_ids, tools.tools)
    message: dict[str, Any] = {"role": "assistant", "content": turn.message.get("content") or None}
    offered = {tool["function"]["name"] for tool in tools.tools}
    if any(call.get("function", call)["name"] not in offered for call in turn.calls):
        # As OpenAI's API: only calls of the request's tools are tool calls (a client's loop
        # would be handed a function it never declared); the model's text is the answer.
        text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
        eos = getattr(tokenizer, "eos_token", None)
        return {"role": "assistant", "content": text.removesuffix(eos) if eos else text}, False
    if not turn.calls:
        message["content"] = message["content"] or ""
        return message, False
    message["tool_calls"] = [
        {
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {
                "name": call.get("function", call)["name"],
                "arguments": json.dumps(call.get("function", call).get("arguments") or {}),
            },
        }
        for call in turn.calls
    ]
    return message, True

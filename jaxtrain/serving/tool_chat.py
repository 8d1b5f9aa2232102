"""Tool calls through the chat template: what a model's turn says (transformers' response
parsing), and the tokens that append tools' answers to a conversation.

Parsing goes through the tokenizer's `response_template` (transformers' chat response
parsing, which types a call's arguments with the tool's JSON schema). A tokenizer without one
whose template writes calls as `<tool_call>{json}</tool_call>` in ChatML turns (Qwen 2.5 / 3,
Hermes, SmolLM3, TOOL_CHAT_TEMPLATE) gets that format's; any other must be given one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from jaxtrain.errors import ArgumentError

__all__ = [
    "TOOL_CHAT_TEMPLATE",
    "ToolTurn",
    "check_tool_template",
    "parse_turn",
    "response_template",
    "tool_suffix_ids",
]

HERMES_OPEN = "<tool_call>"

# A chat template for a tokenizer that has none with tools (a base model taught to call
# them): ChatML turns ended by the tokenizer's own end-of-sequence token, the tools' JSON
# schemas and the call format in a system turn, calls as <tool_call> JSON, answers as a user
# turn.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}To call one, answer <tool_call>\n"
    '{"name": <its name>, "arguments": <an object>}\n</tool_call>'
    "{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response>{{ eos_token }}\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ToolTurn:
    """A model turn, parsed: its message (role, content, tool_calls) and, when it tried to
    call a tool in a form the parser could not read, why (`malformed`)."""

    def __init__(self, message: dict[str, Any], malformed: str | None = None):
        self.message, self.malformed = message, malformed

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.message.get("tool_calls") or []


def response_template(tokenizer: Any) -> dict[str, Any]:
    """The template `parse_turn` reads the tokenizer's turns with (see the module docstring)."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    template = str(getattr(tokenizer, "chat_template", None) or "")
    eos = getattr(tokenizer, "eos_token", None)
    if HERMES_OPEN in template and "<|im_start|>" in template and eos:
        return {
            "defaults": {"role": "assistant"},
            "start_anchor": "<|im_start|>assistant\n",
            "fields": {
                "tool_calls": {
                    "open": HERMES_OPEN,
                    "close_pattern": r"</tool_call>\s*",
                    "repeats": True,
                    "content": "json",
                    "transform": {"type": "function", "function": "{content}"},
                },
                "content": {"close_pattern": re.escape(eos) + r"\s*", "content": "text"},
            },
        }
    raise ArgumentError(
        "tool calling needs to read the model's tool calls: this tokenizer has no "
        "`response_template` and its chat template is not the <tool_call> JSON format. Set "
        "tokenizer.response_template (transformers' chat response parsing; TRL's "
        "add_response_schema sets it for the Llama 3, Qwen, GLM and GPT-OSS templates)."
    )


def _opener(template: dict[str, Any]) -> Callable[[str], bool]:
    """Whether a text holds the start of a tool call, in the template's format."""
    field = template.get("fields", {}).get("tool_calls", {})
    if "open" in field:
        return lambda text: field["open"] in text
    if "open_pattern" in field:
        pattern = re.compile(field["open_pattern"])
        return lambda text: pattern.search(text) is not None
    return lambda text: False


def parse_turn(
    tokenizer: Any,
    template: dict[str, Any],
    ids: Sequence[int],
    prefix: Sequence[int],
    tools: list[Callable],
) -> ToolTurn:
    """The model's turn `ids` (after the conversation `prefix`). A turn the parser cannot
    read is plain text; if it opened a tool call, the call is malformed (said in
    `ToolTurn.malformed`, answered to the model as a failed call)."""
    try:
        message = tokenizer.parse_response(
            list(ids), schema=template, prefix=list(prefix), tools=tools or None
        )
        if message is None:
            raise ValueError("nothing could be parsed")
        calls = message.get("tool_calls")
        if calls is not None:
            _check_calls(calls)
    except (ValueError, TypeError) as exc:
        content = tokenizer.decode(list(ids), skip_special_tokens=True)
        malformed = None
        if _opener(template)(tokenizer.decode(list(ids))):
            malformed = str(exc).strip().splitlines()[0]
        return ToolTurn({"role": "assistant", "content": content}, malformed)
    eos = getattr(tokenizer, "eos_token", None)
    content = message.get("content")
    if isinstance(content, str) and eos:
        content = content.removesuffix(eos)
    message["content"] = content or ""
    return ToolTurn(message)


def _check_calls(calls: Any) -> None:
    """Every call has a function name and (possibly empty) arguments."""
    if not isinstance(calls, list):
        raise ValueError("tool_calls is not a list")
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"a tool call without a function name: {call!r}")
        if function.get("arguments") is None:
            function["arguments"] = {}


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens that follow a model's tool-calling turn (ended by its end-of-turn id): the
    tools' answers and the header of the model's next turn, as the chat template writes them.
    Rendered after a stand-in conversation, then cut where that conversation's turn ends."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    head = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    before = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False)
    after = tokenizer.apply_chat_template(
        head + tool_messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    eos = getattr(tokenizer, "eos_token_id", None)
    ends = [i for i, t in enumerate(before) if t == eos]
    if ends:  # the turn ends at its end-of-turn id; what the template writes after is new
        before = before[: ends[-1] + 1]
    if list(after[: len(before)]) != list(before):
        raise ArgumentError(
            "the chat template renders earlier turns differently once tool answers follow, so "
            "a tool's answer cannot be appended to the sampled tokens; use a template that "
            "keeps the conversation's prefix (every ChatML / Llama 3 / Qwen template does)."
        )
    return list(after[len(before) :])


def check_tool_template(tokenizer: Any) -> None:
    """The chat template shows a tool call and a tool's answer (it is checked once, with
    stand-in names, before any rollout), and turns are parsed."""
    call = {"type": "function", "function": {"name": "probe_tool", "arguments": {"x": "probe_arg"}}}
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "probe_tool", "content": "probe_answer"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as exc:  # jinja's errors: the template rejects tool turns
        raise ArgumentError(
            f"the tokenizer's chat template cannot render a tool call and its answer ({exc}); "
            "GRPO with tools needs a template that does (tools=..., role 'tool')."
        ) from exc
    missing = [s for s in ("probe_tool", "probe_arg", "probe_answer") if s not in text]
    if missing:
        raise ArgumentError(
            f"the tokenizer's chat template drops tool calls or tool answers ({missing} not "
            "rendered); GRPO with tools needs a template that shows both to the model."
        )
    response_template(tokenizer)
    tool_suffix_ids(tokenizer, [messages[2]])

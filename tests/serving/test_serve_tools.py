"""`jaxtrain serve` speaks tools, through the official `openai` client: a model taught to
call a calculator answers with `tool_calls` (streaming too), the client's tool loop sends
the answer back as a `role: tool` message, and what the server cannot do is a 400."""

from __future__ import annotations

import json

import pytest
from tool_chat_fixtures import add, tool_caller, tool_tokenizer

from jaxtrain.hf import save_pretrained
from jaxtrain.serving.tool_chat import TOOL_CHAT_TEMPLATE

openai = pytest.importorskip("openai")

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 5}}\n</tool_call>'
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first integer."},
                "b": {"type": "integer", "description": "The second integer."},
            },
            "required": ["a", "b"],
        },
    },
}
ASK = [{"role": "user", "content": "add 2 and 5"}]


@pytest.fixture(scope="module")
def tok():
    shown = tool_tokenizer(TOOL_CHAT_TEMPLATE, [])
    texts = [CALL, "<tool_response>\n7\n</tool_response>", "add 2 and 5"]
    texts.append(shown.apply_chat_template(ASK, tools=[ADD], tokenize=False))
    return tool_tokenizer(TOOL_CHAT_TEMPLATE, texts)


@pytest.fixture(scope="module")
def server(tok, tmp_path_factory, spawn_server):
    model = tool_caller(tok, [ASK], [ADD], CALL + tok.eos_token)  # shown ADD, as requests do
    path = tmp_path_factory.mktemp("tool_caller") / "hf"
    save_pretrained(model, path, tokenizer=tok)
    process, base = spawn_server(path, "--max_slots", "2", "--model_name", "caller")
    yield base
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0)


def test_a_two_turn_tool_loop_through_the_openai_client(client, tok):
    messages = list(ASK)
    first = client.chat.completions.create(
        model="caller", messages=messages, tools=[ADD], temperature=0, max_tokens=48
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    arguments = json.loads(call.function.arguments)
    assert arguments == {"a": 2, "b": 5}
    # The client's loop: the call as the model made it, the tool's answer, the next turn.
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(add(**arguments))})
    second = client.chat.completions.create(
        model="caller", messages=messages, tools=[ADD], temperature=0, max_tokens=16,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The conversation the model read: its call as JSON, then the tool's answer.
    read = tok.decode(second.model_extra["prompt_token_ids"])
    assert read.endswith(
        f"{CALL}{tok.eos_token}\n<|im_start|>user\n<tool_response>\n7\n</tool_response>"
        f"{tok.eos_token}\n<|im_start|>assistant\n"
    ), read


def test_a_streamed_answer_carries_the_call(client):
    stream = client.chat.completions.create(
        model="caller", messages=ASK, tools=[ADD], temperature=0, max_tokens=48, stream=True
    )
    calls, reasons = [], []
    for event in stream:
        for choice in event.choices:
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls"
    [call] = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 5}


def test_without_tools_the_call_is_plain_text(client):
    out = client.chat.completions.create(
        model="caller", messages=ASK, tools=[ADD], tool_choice="none", temperature=0,
        max_tokens=48,
    )  # fmt: skip
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason != "tool_calls"


def test_a_call_of_a_function_the_request_did_not_offer_is_text(tok):
    """It came back as a tool call (finish_reason "tool_calls"): a client's loop was handed a
    function it never declared. The streamed and whole answers both read it here."""
    from jaxtrain.serving.tool_api import read_tools, tool_message

    shown = tok.apply_chat_template(ASK, tools=[ADD], add_generation_prompt=True, tokenize=False)
    prompt = tok(shown, add_special_tokens=False)["input_ids"]
    made = tok(CALL + tok.eos_token, add_special_tokens=False)["input_ids"]
    subtract = {"type": "function", "function": {**ADD["function"], "name": "subtract"}}
    for offered, called in [([ADD], True), ([subtract], False)]:
        tools = read_tools({"tools": offered}, tok, RuntimeError)
        message, was_call = tool_message(tools, tok, made, list(prompt))
        assert was_call is called and ("tool_calls" in message) is called
        if not called:
            assert '"name": "add"' in message["content"] and tok.eos_token not in message["content"]


@pytest.mark.parametrize(
    "extra, said",
    [
        ({"tools": [ADD], "tool_choice": "required"}, "tool_choice 'required' is not supported"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0] must"),
        ({"tools": []}, "non-empty list"),
    ],
)
def test_what_the_server_cannot_do_is_a_400(client, extra, said):
    with pytest.raises(openai.BadRequestError, match=said.replace("[", r"\[")):
        client.chat.completions.create(model="caller", messages=ASK, max_tokens=4, **extra)

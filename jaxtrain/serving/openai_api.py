"""OpenAI's request and response shapes: parsing a completion or chat request into the
engine's terms, and the JSON (or server-sent event chunks) the `openai` client reads back.

Pure functions of dicts: the HTTP server (server.py) calls them. A request that cannot be
served raises `RequestError` with the status code and OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxtrain.data.vision import is_processor, text_tokenizer
from jaxtrain.serving.chat_messages import checked_messages
from jaxtrain.serving.image_parts import image_prompt
from jaxtrain.serving.limits import ServeLimits
from jaxtrain.serving.logprobs_api import chat_logprobs, completion_logprobs, requested
from jaxtrain.serving.sampling import SamplingParams
from jaxtrain.serving.tool_api import ToolRequest, read_tools, template_messages, tool_message

__all__ = ["ParsedRequest", "RequestError", "chunk", "error_body", "parse_request", "response"]

# Each status's default `code` and `type`, as OpenAI's API spells them (its clients branch on
# the status; people and logs read these).
_CODES = {
    401: "invalid_api_key",
    404: "model_not_found",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "server_shutting_down",
    504: "timeout",
}
_TYPES = {404: "not_found_error", 429: "requests"}


class RequestError(Exception):
    """A request the server refuses: `status` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or _CODES.get(status, "invalid_request")


def error_body(err: RequestError) -> dict[str, Any]:
    kind = _TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


@dataclasses.dataclass
class ParsedRequest:
    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: the prompt's and each sample's ids
    logprobs: int | None = None  # alternatives per token wanted; None: no log-probs
    tools: ToolRequest | None = None  # the tools shown; the samples' calls are read back
    images: Any = None  # a vision-language model's prompt: its images' pixels [n, C, H, W]
    model: str = ""  # the model asked for: the base's name or a LoRA adapter's
    adapter: int = 0  # that adapter's index (serving/adapters.py; 0: the base)


def _number(body: dict, name: str, default: Any, kind: type, low: float | None = None) -> Any:
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a finite number, got {value!r}", name)
    if kind is int and int(value) != value:
        raise RequestError(400, f"'{name}' must be an integer, got {value!r}", name)
    if low is not None and value < low:
        raise RequestError(400, f"'{name}' must be >= {low}, got {value!r}", name)
    return kind(value)


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# OpenAI's fields this server does not implement, with the values that ask for nothing: a
# request that sets one otherwise is refused (400), not answered as if it had not asked (a
# client reading `echo`'s prompt log-probs, or parsing a `response_format` JSON, would get
# wrong data without a word).
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "response_format": (None, {"type": "text"}),
}


def _refuse_unsupported(body: dict) -> None:
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise RequestError(
                400, f"'{name}' is not supported by this server (got {body[name]!r}); leave it "
                "out", name,
            )  # fmt: skip


def _refuse_unencodable(body: dict) -> None:
    """A 400 for text that is no Unicode (a lone surrogate such as "\\ud800", which JSON lets
    through): the tokenizer would fail on it, as a 500."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(
            400, f"the request holds text that is not valid Unicode ({err.reason} at "
            f"{err.object[max(err.start - 20, 0) : err.start]!r}...)",
        ) from None  # fmt: skip


def _seed(body: dict) -> int:
    """The request's seed; without one a fresh draw each time, as OpenAI's API and vLLM give
    (a fixed default would answer every unseeded request alike: retries and RL rollouts over
    HTTP would get copies)."""
    if body.get("seed") is None:
        return secrets.randbits(32)
    return _number(body, "seed", 0, int)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool) and value is not None:
        raise RequestError(400, f"'{name}' must be true or false, got {value!r}", name)
    return bool(value)


def parse_request(
    body: Any,
    *,
    chat: bool,
    model_name: str,
    tokenizer: Any,
    max_length: int,
    limits: ServeLimits | None = None,
    vocab_size: int | None = None,
    adapters: Sequence[str] = (),
) -> ParsedRequest:
    """The engine's request for an OpenAI completion (`chat` False) or chat body, within
    `limits` (filled in for the engine: `ServeLimits.for_engine`; None: the context only).
    `vocab_size`: the model's; a token id outside it is refused (400): its embedding would be
    NaN, and the NaN it writes to the KV cache stays in pages that later requests reuse.
    `adapters`: the LoRA adapters served on the model, by name (`model` picks one)."""
    limits = limits or ServeLimits().for_engine(max_length, max_length)
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    _refuse_unencodable(body)
    _refuse_unsupported(body)
    if not chat and "max_completion_tokens" in body:  # chat's name; a completion's is max_tokens
        raise RequestError(
            400, "'max_completion_tokens' is a chat completions field; a completion takes "
            "'max_tokens'", "max_completion_tokens",
        )  # fmt: skip
    model, served = body.get("model"), [model_name, *adapters]
    if model is None:
        raise RequestError(400, f"'model' is required; this server serves {served[0]!r}", "model")
    if model not in served:
        raise RequestError(
            404, f"the model {model!r} does not exist; this server serves "
            f"{', '.join(map(repr, served))}", "model",
        )  # fmt: skip
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of messages", "messages")
        tools = read_tools(body, tokenizer, RequestError)
        vision = is_processor(tokenizer)  # a vision-language model: messages may hold images
        messages = checked_messages(messages, text_only=not vision, error=RequestError)
        messages = template_messages(messages, RequestError)
        images = None
        if vision:
            ids, images = image_prompt(
                tokenizer, messages, tools.tools if tools else None, RequestError
            )
        else:
            try:
                ids = tokenizer.apply_chat_template(
                    messages,
                    tools=tools.tools if tools else None,
                    add_generation_prompt=True,
                    tokenize=True,
                )
            except Exception as err:  # a malformed message or a tokenizer without a template
                raise RequestError(
                    400, f"the messages cannot be rendered: {err}", "messages"
                ) from None
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        tools = images = None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt (a list of one id is a prompt itself)
        if isinstance(prompt, str):
            ids = list(text_tokenizer(tokenizer)(prompt, add_special_tokens=True)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(_token(t) for t in prompt):
            ids = list(prompt)
        else:
            raise RequestError(
                400, "'prompt' must be a string or a list of token ids (one prompt)", "prompt"
            )
    if not ids:
        raise RequestError(400, "the prompt is empty", "prompt")
    outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        raise RequestError(
            400,
            f"token id {outside[0]} is outside this model's vocabulary (ids from 0"
            + ("" if vocab_size is None else f" to {vocab_size - 1}")
            + ")",
            "messages" if chat else "prompt",
        )
    if len(ids) > limits.max_prompt_tokens:
        raise RequestError(
            400,
            f"the prompt has {len(ids)} tokens; this server takes at most "
            f"{limits.max_prompt_tokens}",
            "messages" if chat else "prompt",
            "prompt_too_long",
        )
    limit = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default_max = max(1, min(16 if not chat else 256, max_length - len(ids), limits.max_tokens))
    max_tokens = _number(body, limit, default_max, int, 1)
    if len(ids) + max_tokens > max_length:
        raise RequestError(
            400,
            f"the prompt ({len(ids)} tokens) plus {limit} ({max_tokens}) exceeds this model's "
            f"context of {max_length} tokens; shorten the prompt or lower {limit}",
            limit,
            "context_length_exceeded",
        )
    if max_tokens > limits.max_tokens:
        raise RequestError(
            400, f"{limit} is {max_tokens}; this server allows at most {limits.max_tokens}", limit
        )
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a string or a list of strings", "stop")
    if len(stop) > limits.max_stop:
        raise RequestError(
            400, f"{len(stop)} stop strings; this server takes at most {limits.max_stop}", "stop"
        )
    if any(len(s) > limits.max_stop_length for s in stop):
        raise RequestError(
            400,
            f"a stop string is longer than this server's {limits.max_stop_length} characters",
            "stop",
        )
    n = _number(body, "n", 1, int, 1)
    logprobs = requested(body, chat, RequestError)
    if n > limits.max_n:
        raise RequestError(400, f"n is {n}; this server allows at most {limits.max_n}", "n")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, float, 0.0),
        # OpenAI's top_p 0 keeps the most likely token alone, as the smallest positive one does.
        top_p=_number(body, "top_p", 1.0, float, 0.0) or float(np.finfo(np.float32).tiny),
        top_k=_number(body, "top_k", 0, int, 0),
        seed=_seed(body),
        stop=tuple(stop),
        ignore_eos=_flag(body, "ignore_eos"),  # vLLM's extension: exactly max_tokens tokens
        logprobs=logprobs or 0,
    )
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise RequestError(
            400, f"'stream_options' must be an object, got {stream_options!r}", "stream_options"
        )
    return ParsedRequest(
        chat=chat,
        prompt_ids=ids,
        params=params,
        n=n,
        stream=_flag(body, "stream"),
        include_usage=_flag(stream_options, "include_usage"),
        return_token_ids=_flag(body, "return_token_ids"),
        logprobs=logprobs,
        tools=tools,
        images=images,
        model=model,
        adapter=served.index(model),
    )


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_field(
    request: ParsedRequest,
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
    text_offset: int = 0,
) -> dict[str, Any] | None:
    """A choice's `logprobs` in the request's shape (None unless it asked)."""
    if request.logprobs is None:
        return None
    if request.chat:
        return chat_logprobs(tokenizer, token_ids, logprobs, top)
    return completion_logprobs(tokenizer, token_ids, logprobs, top, text_offset)


def response(
    request: ParsedRequest, model: str, samples: list[Any], tokenizer: Any = None
) -> dict[str, Any]:
    """The whole (non-streaming) answer: one choice per sample (the engine's Completions,
    in index order)."""
    choices = []
    for i, sample in enumerate(samples):
        text = sample.text or ""
        choice: dict[str, Any] = {"index": i}
        choice["finish_reason"] = sample.finish_reason
        if request.tools is not None:
            choice["message"], called = tool_message(
                request.tools, tokenizer, sample.token_ids, request.prompt_ids
            )
            choice["finish_reason"] = "tool_calls" if called else sample.finish_reason
        elif request.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs_field(
            request, tokenizer, sample.token_ids, sample.logprobs, sample.top_logprobs
        )
        if request.return_token_ids:
            choice["token_ids"] = list(sample.token_ids)
        choices.append(choice)
    body = {
        "id": new_id(request.chat),
        "object": "chat.completion" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(len(request.prompt_ids), sum(len(s.token_ids) for s in samples)),
    }
    if request.return_token_ids:
        body["prompt_token_ids"] = list(request.prompt_ids)
    return body


def chunk(
    request: ParsedRequest,
    model: str,
    stream_id: str,
    index: int,
    text: str | None,
    reason: str | None,
    *,
    first: bool = False,
    token_ids: list[int] | None = None,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One server-sent event of a stream: sample `index`'s new text, or its end. With
    `return_token_ids`, the ids of the tokens that arrived since the sample's last event
    (their concatenation is the sample's ids), and the prompt's ids on a `first` event."""
    if request.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:  # whole calls, each with its place in the list
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
    body = {
        "id": stream_id,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if request.return_token_ids:
        choice["token_ids"] = list(token_ids or [])
        if first:
            body["prompt_token_ids"] = list(request.prompt_ids)
    return body

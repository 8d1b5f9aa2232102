"""OpenAI's log-prob fields: what a request asks (`logprobs`, `top_logprobs`) and the shapes
the answer carries, from the engine's per-token log-probs (the model's log_softmax, before
temperature and filters: what RL's importance ratios need).

Completions (legacy): `"logprobs": k` (0 to 20; 0 gives the sampled tokens' only) answers
`{tokens, token_logprobs, top_logprobs, text_offset}` per choice. Chat: `"logprobs": true`
and `"top_logprobs": k` answer `{"content": [{token, logprob, bytes, top_logprobs}], ...}`.
A token's text is its own decode: a byte-level token that holds part of a character reads
as U+FFFD (its `bytes` then are those of that text, not the raw bytes).
"""

from __future__ import annotations

from typing import Any

__all__ = ["requested", "completion_logprobs", "chat_logprobs"]

MAX_K = 20  # OpenAI's limit on top_logprobs; the engine ranks at most this many


def requested(body: dict, chat: bool, error: type[Exception]) -> int | None:
    """How many alternatives per token the request wants (None: no log-probs at all)."""

    def count(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_K:
            raise error(400, f"'{name}' must be an integer from 0 to {MAX_K}, got {value!r}", name)
        return value

    if not chat:
        value = body.get("logprobs")
        return None if value is None else count("logprobs", value)
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked not in (None, True, False):
        raise error(400, f"'logprobs' must be true or false, got {asked!r}", "logprobs")
    if not asked:
        if top is not None:
            raise error(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return 0 if top is None else count("top_logprobs", top)


def _text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
    start: int = 0,
) -> dict[str, Any]:
    """The legacy completion shape; `start`: the text offset of the first token (a stream
    chunk's tokens continue the sample's text)."""
    tokens = [_text(tokenizer, t) for t in token_ids]
    offsets, at = [], start
    for text in tokens:
        offsets.append(at)
        at += len(text)
    ranked = None
    if top is not None:
        ranked = []
        for alts in top:  # keyed by text, as OpenAI's shape is: two ids may read the same,
            by_text: dict[str, float] = {}  # and the likelier (ranked first) keeps the key
            for t, lp in alts.items():
                by_text.setdefault(_text(tokenizer, t), lp)
            ranked.append(by_text)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": ranked,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    logprobs: list[float],
    top: list[dict[int, float]] | None,
) -> dict[str, Any]:
    """The chat shape: one entry per token, its alternatives beside it."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for i, (token, logprob) in enumerate(zip(token_ids, logprobs)):
        alternatives = top[i] if top is not None else {}
        item = entry(token, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in alternatives.items()]
        content.append(item)
    return {"content": content, "refusal": None}

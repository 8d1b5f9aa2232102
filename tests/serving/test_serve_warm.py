"""A warm server compiles nothing: after `jaxtrain serve`'s warm-up (cli/serve.py's own
`warm_up`, with the server's prompt-token limit), 100 mixed requests through the official
`openai` client (completions and chat, streaming or not, n of 1 to 3, greedy and sampled with
top-p and top-k, log-probs, prompts of 1 to 64 tokens, stop strings), sent concurrently, make
JAX compile nothing, and the engine's KV pool is back to empty once they end.

In-process (create_app + uvicorn on a thread), where the engine can be looked at. JAX's
compile log is switched on with `jax.config.update`, not `with jax.log_compiles(True)`: the
context manager is thread-local, and the engine steps on a thread of its own."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from engine_models import CompileLog  # noqa: E402

PROMPT_LIMIT = 64  # the server's --max_prompt_tokens: the warm-up compiles up to it
WORDS = ["def", "add(a,", "b):", "return", "a", "+", "b", "the", "quick", "brown", "fox",
         "jumps", "import", "os", "print(", "x", "o", "\n"]  # fmt: skip


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def requests_mix(tokenizer, count: int, seed: int = 0) -> list[dict]:
    """`count` request specs: (route, keyword arguments of the openai client's call)."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(count):
        chat, stream, n = bool(i % 2), bool((i // 2) % 2), 1 + i % 3
        words = int(rng.integers(1, 40))
        text = " ".join(rng.choice(WORDS, words))
        if chat:
            ids = chat_ids(tokenizer, text)
            while len(ids) > PROMPT_LIMIT:
                text = text[: len(text) // 2]
                ids = chat_ids(tokenizer, text)
            call = {"messages": [{"role": "user", "content": text}]}
        elif i % 4 == 0:  # token ids as the prompt: any length from 1 to the limit
            ids = rng.integers(3, len(tokenizer), int(rng.integers(1, PROMPT_LIMIT + 1))).tolist()
            call = {"prompt": ids}
        else:
            ids = tokenizer(text)["input_ids"][:PROMPT_LIMIT]
            call = {"prompt": tokenizer.decode(ids)}
            ids = tokenizer(call["prompt"])["input_ids"]
            assert len(ids) <= PROMPT_LIMIT
        call["max_tokens"] = int(rng.integers(1, 25))
        call["n"] = n
        kind = i % 5
        if kind in (0, 3):
            call["temperature"] = 0.0
        else:
            call["temperature"], call["seed"] = float(rng.uniform(0.5, 1.5)), i
            if kind == 1:
                call["top_p"] = 0.8
            elif kind == 2:
                call["extra_body"] = {"top_k": int(rng.integers(1, 20))}
        if i % 3 == 0:
            if chat:
                call["logprobs"], call["top_logprobs"] = True, int(rng.integers(0, 4))
            else:
                call["logprobs"] = int(rng.integers(0, 4))
        if i % 7 == 0:
            call["stop"] = ["a", "\n"] if i % 2 else " b"
        if stream:
            call["stream"], call["stream_options"] = True, {"include_usage": True}
        specs.append({"chat": chat, "prompt_tokens": len(ids), **call})
    return specs


def run(client, spec: dict) -> None:
    """Send one request and check its answer's shape (raises on anything wrong)."""
    spec = dict(spec)
    chat, prompt_tokens = spec.pop("chat"), spec.pop("prompt_tokens")
    create = client.chat.completions.create if chat else client.completions.create
    answer = create(model="tiny", **spec)
    n, stops = spec["n"], spec.get("stop") or []
    stops = [stops] if isinstance(stops, str) else stops
    texts, reasons, tokens = [""] * n, [None] * n, [0] * n
    if spec.get("stream"):
        usage = None
        for piece in answer:
            if piece.usage is not None:
                usage = piece.usage
            for choice in piece.choices:
                i = choice.index
                texts[i] += (choice.delta.content if chat else choice.text) or ""
                reasons[i] = choice.finish_reason or reasons[i]
                lp = choice.logprobs
                tokens[i] += len((lp.content if chat else lp.tokens) or []) if lp else 0
        assert usage is not None
    else:
        usage = answer.usage
        assert len(answer.choices) == n
        for choice in answer.choices:
            i = choice.index
            texts[i] = choice.message.content if chat else choice.text
            reasons[i] = choice.finish_reason
            lp = choice.logprobs
            tokens[i] = len(lp.content if chat else lp.tokens) if lp else 0
    assert usage.prompt_tokens == prompt_tokens
    assert n <= usage.completion_tokens <= n * spec["max_tokens"]
    assert all(reason in ("stop", "length") for reason in reasons), reasons
    assert not any(s in text for s in stops for text in texts), (stops, texts)
    if spec.get("logprobs") is not None and spec.get("logprobs") is not False:
        assert sum(tokens) == usage.completion_tokens  # one log-prob per token
    if spec["temperature"] == 0 and not spec.get("stream"):
        assert len(set(texts)) == 1  # greedy samples agree


def test_a_warm_server_compiles_nothing_over_100_mixed_requests(model_dir, free_port):
    import uvicorn

    from jaxtrain.cli.serve import warm_up
    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.serving import Engine
    from jaxtrain.serving.limits import ServeLimits
    from jaxtrain.serving.server import create_app

    model, tokenizer, _ = load_served_model(model_dir)
    engine = Engine(model, tokenizer=tokenizer, max_slots=4)
    limits = ServeLimits(max_prompt_tokens=PROMPT_LIMIT)
    line = warm_up(engine, limits.max_prompt_tokens)  # what `jaxtrain serve` runs and prints
    said = r"jaxtrain serve: compiled (\d+) shapes in [\d.]+ s \(prompts up to 64 tokens\)"
    found = re.fullmatch(said, line)
    assert found and int(found.group(1)) > 0, line
    app = create_app(engine, model_name="tiny", tokenizer=tokenizer, limits=limits)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    specs = requests_mix(tokenizer, 100)
    assert {s["chat"] for s in specs} == {True, False} and {s["n"] for s in specs} == {1, 2, 3}
    assert (
        min(s["prompt_tokens"] for s in specs) <= 4 < 56 <= max(s["prompt_tokens"] for s in specs)
    )
    try:
        while not server.started:
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        with CompileLog() as log:
            # The log sees compiles on other threads than this one (the engine's).
            other = threading.Thread(target=lambda: jax.jit(lambda x: x + 1)(np.float32(1)))
            other.start()
            other.join()
            assert log.compiled["<lambda>"] == 1, log.compiled
            log.compiled.clear()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda spec: run(client, spec), specs))
        assert not log.compiled, log.compiled
        deadline = time.monotonic() + 30
        while not engine.idle:
            assert time.monotonic() < deadline, "the engine still holds requests"
            time.sleep(0.02)
        # Every page back: those of cached prompt prefixes count as available.
        assert engine.pages.available == engine.pages.num_pages - 1
    finally:
        server.should_exit = True
        thread.join(timeout=20)

"""`jaxtrain serve` as a real process, called with the official `openai` client: completions,
chat, streaming, n=2, usage, 8 concurrent clients, and every bad request answered with a 4xx in
OpenAI's shape while the server keeps serving. A client that disconnects mid-stream frees its
slot (checked in-process, where the engine can be looked at)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import transformers

openai = pytest.importorskip("openai")

from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.models import generate  # noqa: E402

PROMPTS = ["def add(a, b):", "the quick brown", "import os", "print(", "return a", "fox", "x", "o"]


@pytest.fixture(scope="module")
def expected(model_dir):
    """Greedy text of a prompt's ids from jaxtrain's own `generate` (stops at eos)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    def greedy(ids: list[int], max_tokens: int) -> tuple[str, int]:
        new = generate(model, ids, max_new_tokens=max_tokens, eos_token_id=1).tolist()
        return tokenizer.decode(new, skip_special_tokens=True), len(new)

    return tokenizer, greedy


@pytest.fixture(scope="module")
def server(model_dir, spawn_server):
    process, base = spawn_server(model_dir, "--max_slots", "4", "--model_name", "tiny")
    yield base
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0)


def test_models_and_greedy_completions(client, expected):
    tokenizer, greedy = expected
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    text, count = greedy(ids, 12)
    assert out.choices[0].text == text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == count
    assert out.choices[0].finish_reason in ("stop", "length")


def test_chat_applies_the_template(client, expected):
    tokenizer, greedy = expected
    messages = [{"role": "user", "content": "def add"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == greedy(ids, 10)[0]
    assert out.usage.prompt_tokens == len(ids)


def test_streaming_gives_the_same_text_in_pieces(client):
    whole = client.completions.create(model="tiny", prompt="import", max_tokens=14, temperature=0)
    pieces = list(
        client.completions.create(
            model="tiny", prompt="import", max_tokens=14, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    chat = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "fox"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].usage.completion_tokens >= 1 and chat[-1].choices == []


def test_n_samples_with_a_seed(client):
    kw = dict(model="tiny", prompt="the quick", max_tokens=10, temperature=1.5, n=2, seed=7)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == again.usage.completion_tokens >= 2


def test_eight_concurrent_clients(client, expected):
    tokenizer, greedy = expected

    def ask(prompt: str) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, PROMPTS))
    assert got == [greedy(tokenizer(p)["input_ids"], 16)[0] for p in PROMPTS]


@pytest.mark.parametrize(
    "body,status,code",
    [
        ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 500}, 400, "context_length_exceeded"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "invalid_request"),
        ({"model": "tiny", "prompt": "x", "n": 0}, 400, "invalid_request"),
        ({"model": "tiny", "prompt": "x", "n": 9}, 400, "invalid_request"),
        ({"model": "tiny", "messages": "hello"}, 400, "invalid_request"),
        ("{not json", 400, "invalid_request"),
        # Once 500s: a lone surrogate reached the tokenizer, a deep body json.loads' recursion.
        ({"model": "tiny", "prompt": "\ud800"}, 400, "invalid_request"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "a\udfff"}]},
            400,
            "invalid_request",
        ),
        ({"model": "tiny", "prompt": "x", "stop": ["\ud800"]}, 400, "invalid_request"),
        ('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "invalid_request"),
        # Once silently ignored (max_completion_tokens) or a 404 of the model None.
        ({"model": "tiny", "prompt": "x", "max_completion_tokens": 2}, 400, "invalid_request"),
        ({"prompt": "x"}, 400, "invalid_request"),
        # Once answered 500 in plain text (int(inf), .get on a string) or streamed ("false").
        ({"model": "tiny", "prompt": "x", "max_tokens": float("inf")}, 400, "invalid_request"),
        ({"model": "tiny", "prompt": "x", "temperature": float("nan")}, 400, "invalid_request"),
        (
            {"model": "tiny", "prompt": "x", "stream": True, "stream_options": "yes"},
            400,
            "invalid_request",
        ),
        ({"model": "tiny", "prompt": "x", "stream": "false"}, 400, "invalid_request"),
        # Once silently ignored: the answer was not what was asked.
        ({"model": "tiny", "prompt": "x", "echo": True}, 400, "invalid_request"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 100}}, 400, "invalid_request"),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
            400,
            "invalid_request",
        ),
        (
            {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "invalid_request",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            400,
            "invalid_request",
        ),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server, client, body, status, code
):
    chat = isinstance(body, dict) and "messages" in body
    url = f"{server}/{'chat/completions' if chat else 'completions'}"
    data = body if isinstance(body, str) else json.dumps(body)
    answer = httpx.post(url, content=data, headers={"content-type": "application/json"})
    assert answer.status_code == status
    error = answer.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_one_model_is_retrieved_by_its_id(client):
    """GET /v1/models/{id} was a 404, so the openai client's models.retrieve failed."""
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist"):
        client.models.retrieve("nope")


def test_unknown_routes_and_methods_answer_in_openai_s_shape(server):
    root = server.removesuffix("/v1")
    for answer, status in ((httpx.get(f"{root}/v1/nope"), 404),
                           (httpx.post(f"{root}/v1/models"), 405)):  # fmt: skip
        assert answer.status_code == status
        assert answer.json()["error"]["message"].endswith(("Not Found", "Method Not Allowed"))


def test_a_long_prompt_is_tokenized_without_stalling_the_server(server):
    """Tokenizing a prompt of a megabyte took seconds on the event loop: /health and every
    stream waited. The prompt is refused (too long for the model) once tokenized; /health,
    asked meanwhile, answers first."""
    root, done = server.removesuffix("/v1"), {}
    body = {"model": "tiny", "prompt": "the quick brown fox jumps over " * 30_000}

    def post():
        done["answer"] = httpx.post(f"{server}/completions", json=body, timeout=120)
        done["at"] = time.monotonic()

    thread = threading.Thread(target=post)
    thread.start()
    time.sleep(0.5)  # the body is in; its tokenization takes seconds
    health = httpx.get(f"{root}/health", timeout=120)
    health_at = time.monotonic()
    thread.join()
    assert health.status_code == 200 and done["answer"].status_code == 400
    assert "prompt" in done["answer"].json()["error"]["message"]
    assert health_at < done["at"]


def test_a_stream_sends_no_stop_string_nor_what_follows_it(client):
    """A stream once sent the first character of a stop string it had just completed (all of
    a one-character one) and the rest of that token, and counted `text_offset` from the text
    it had sent. Now its pieces join to the text without `stream`, and so do the offsets."""
    ask = dict(model="tiny", prompt="import", max_tokens=14, temperature=0, logprobs=1,
               extra_body={"ignore_eos": True})  # fmt: skip
    text = client.completions.create(**ask).choices[0].text
    assert len(text) >= 6, text
    for stop in (text[4], text[3:6], [text[5:7], text[2]]):
        whole = client.completions.create(**ask, stop=stop).choices[0]
        first = min(text.find(s) for s in ([stop] if isinstance(stop, str) else stop))
        assert whole.text == text[:first] and whole.finish_reason == "stop", (stop, whole)
        pieces = list(client.completions.create(**ask, stop=stop, stream=True))
        assert "".join(p.choices[0].text for p in pieces) == whole.text, stop
        streamed = [o for p in pieces if p.choices[0].logprobs
                    for o in p.choices[0].logprobs.text_offset]  # fmt: skip
        assert streamed == whole.logprobs.text_offset, stop


def test_unseeded_requests_draw_afresh_and_top_p_0_keeps_the_likeliest(client):
    """Without a seed every request once drew the same text (seed 0); top_p 0 once meant 1."""
    ask = dict(model="tiny", prompt="the quick", max_tokens=10, temperature=1.5,
               extra_body={"ignore_eos": True})  # fmt: skip
    texts = {client.completions.create(**ask).choices[0].text for _ in range(3)}
    assert len(texts) > 1, texts
    greedy = client.completions.create(**{**ask, "temperature": 0}).choices[0].text
    for seed in (1, 2):
        assert client.completions.create(**ask, top_p=0, seed=seed).choices[0].text == greedy


def test_a_prompt_of_one_token_id_and_text_parts_of_a_chat(client, expected):
    """`prompt: [id]` was read as a batch of one and refused; content parts (current clients
    send them for text) were refused by a text model's template."""
    tokenizer, greedy = expected
    one = tokenizer("fox")["input_ids"][-1:]
    ask = dict(model="tiny", max_tokens=6, temperature=0)
    assert client.completions.create(**ask, prompt=one).choices[0].text == greedy(one, 6)[0]
    parts = [{"type": "text", "text": "def"}, {"type": "text", "text": "add"}]
    as_parts = client.chat.completions.create(**ask, messages=[{"role": "user", "content": parts}])
    as_text = client.chat.completions.create(
        **ask, messages=[{"role": "user", "content": "def\nadd"}]
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_the_server_keeps_an_idle_connection_longer_than_the_client_pools_it(server):
    """CI once failed a request with "Server disconnected without sending a response": uvicorn
    closed an idle keep-alive connection after its default 5 s, in the instant the openai
    client (which pools one for 5 s too) sent on it."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    host, port = httpx.URL(server).host, httpx.URL(server).port
    connection = http.client.HTTPConnection(host, port, timeout=10)
    connection.request("GET", "/health")
    assert connection.getresponse().read()
    time.sleep(DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 1)
    connection.request("GET", "/health")  # on the same socket: the server has not closed it
    assert connection.getresponse().status == 200
    connection.close()


def test_a_client_that_disconnects_mid_stream_frees_its_slot(model_dir, free_port):
    import uvicorn

    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.serving import Engine
    from jaxtrain.serving.server import create_app

    model, tokenizer, _ = load_served_model(model_dir)
    engine = Engine(model, tokenizer=tokenizer, max_slots=2, eos_token_ids=[])
    cut_at = []  # tokens each cancelled sequence had when it was cancelled
    cancel = engine.cancel

    def spy(request_id):
        cut_at.extend(len(s.generated) for s in engine.active if s.request_id == request_id)
        cancel(request_id)

    engine.cancel = spy
    app = create_app(engine, model_name="tiny", tokenizer=tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        body = {"model": "tiny", "prompt": "def", "max_tokens": 90, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # it is decoding
        # The connection is closed: the request is cancelled mid-decode, its slot and pages
        # freed at once.
        deadline = time.monotonic() + 20
        while (engine.active or not cut_at) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cut_at and 1 <= cut_at[0] < 90, cut_at
        assert not engine.active
        assert engine.pages.available == engine.pages.num_pages - 1
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_a_lora_export_is_served_merged_onto_its_local_base(model_dir, tmp_path):
    """A PEFT adapter directory (jaxtrain's own export) loads as its base with B @ A * alpha
    / r added to each adapted weight: the logits of jaxtrain's merged model."""
    import jax
    import numpy as np

    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.hf.peft import save_peft_adapter
    from jaxtrain.models.lora import apply_lora, lora_projections, merge_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_lora(model, rank=4, alpha=8.0, targets=["attention", "mlp"], seed=3)
    for i, (_, projection) in enumerate(lora_projections(model)):  # B starts at 0: move it
        b = projection.lora.b
        b[...] = jax.random.normal(jax.random.key(i), b[...].shape) * 0.1
    save_peft_adapter(model, tmp_path / "adapter", base_model=str(model_dir))
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "adapter")
    served, tokenizer, name = load_served_model(tmp_path / "adapter")
    ids = np.asarray([tokenizer("def add(a, b):")["input_ids"]])
    np.testing.assert_allclose(
        np.asarray(served(ids)), np.asarray(merge_lora(model)(ids)), rtol=1e-5, atol=1e-5
    )
    assert name == "adapter"

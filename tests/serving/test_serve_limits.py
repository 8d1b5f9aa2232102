"""`jaxtrain serve` hardened for a network, as a real process, through the official `openai`
client and raw HTTP: the API key (401), each limit and its status (413, 400), the queue limit
(429 with Retry-After), /health and /metrics (Prometheus text whose values follow the
requests), token ids on request, and the refusal to bind off loopback without a key. The
timeout is checked in-process, where the engine's pages can be looked at."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import transformers

openai = pytest.importorskip("openai")

KEY = "sk-test-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
LIMITS = [
    "--max_slots", "2", "--max_queue", "1", "--max_prompt_tokens", "32", "--max_tokens", "900",
    "--max_n", "2", "--max_stop", "2", "--max_stop_length", "8", "--max_body_bytes", "2048",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(long_model_dir, spawn_server):
    """One server for the file: the key from the environment, small limits."""
    process, base = spawn_server(
        long_model_dir, "--model_name", "tiny", *LIMITS, env={"JAXTRAIN_API_KEY": KEY}
    )
    yield base
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(long_model_dir):
    return transformers.AutoTokenizer.from_pretrained(long_model_dir)


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics by its name and labels ('name{label="v"}')."""
    answer = httpx.get(base.removesuffix("/v1") + "/metrics", headers=AUTH, timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {}
    for line in answer.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_every_route_but_health_needs_the_key(server, client):
    root = server.removesuffix("/v1")
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                         ("GET", "/no/such/route")]:  # fmt: skip
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            answer = httpx.request(method, root + path, headers=headers, json={"model": "tiny"})
            assert answer.status_code == 401, (path, headers)
            error = answer.json()["error"]
            assert error["code"] == "invalid_api_key" and error["message"]
            assert answer.headers["www-authenticate"] == "Bearer"
    health = httpx.get(root + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    wrong = openai.OpenAI(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client.models.list().data] == ["tiny"]


def _post(server: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server}/completions", headers=AUTH, timeout=60, **kw, json=body)


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"prompt": [5] * 33}, "prompt", "prompt_too_long"),
        ({"prompt": "x", "max_tokens": 901}, "max_tokens", "invalid_request"),
        ({"prompt": "x", "n": 3}, "n", "invalid_request"),
        ({"prompt": "x", "stop": ["a", "b", "c"]}, "stop", "invalid_request"),
        ({"prompt": "x", "stop": "123456789"}, "stop", "invalid_request"),
        ({"prompt": "x", "return_token_ids": "yes"}, "return_token_ids", "invalid_request"),
        # Ids outside the embedding: their NaN would stay in KV pages later requests reuse.
        ({"prompt": [5, 259]}, "prompt", "invalid_request"),
        ({"prompt": [-1, 5]}, "prompt", "invalid_request"),
    ],
)
def test_each_limit_answers_400_in_openai_s_shape(server, client, body, param, code):
    answer = _post(server, {"model": "tiny", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    rest = {k: v for k, v in body.items() if k != "prompt"}
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=body["prompt"], extra_body=rest)


def test_the_limits_at_their_bound_are_served(server, client):
    out = client.completions.create(
        model="tiny", prompt=[5] * 32, max_tokens=3, n=2, stop=["12345678", "zz"], temperature=0
    )
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 32
    last = client.completions.create(model="tiny", prompt=[0, 258], max_tokens=2)
    assert last.usage.prompt_tokens == 2  # the vocabulary's first and last ids (259 of them)


def test_a_body_over_the_limit_answers_413(server, client):
    big = {"model": "tiny", "prompt": "x" * 3000}
    answer = _post(server, big)  # declared by Content-Length: refused before it is read
    assert answer.status_code == 413
    assert answer.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        data = json.dumps(big).encode()
        for start in range(0, len(data), 500):
            yield data[start : start + 500]

    answer = httpx.post(f"{server}/completions", headers=AUTH, content=chunks(), timeout=60)
    assert answer.status_code == 413
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="x" * 3000)
    assert caught.value.status_code == 413


def test_token_ids_on_request(server, client, tokenizer):
    prompt = "the quick brown"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids = tokenizer(prompt)["input_ids"]
    assert out.model_extra["prompt_token_ids"] == ids
    tokens = out.choices[0].model_extra["token_ids"]
    assert len(tokens) == out.usage.completion_tokens
    assert tokenizer.decode(tokens, skip_special_tokens=True) == out.choices[0].text
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert "prompt_token_ids" not in (plain.model_extra or {})
    pieces = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
    )
    assert pieces[0].model_extra["prompt_token_ids"] == ids
    assert [t for p in pieces for t in p.choices[0].model_extra["token_ids"]] == tokens
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=6,
        temperature=0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    chat_ids = chat.choices[0].model_extra["token_ids"]
    assert len(chat_ids) == chat.usage.completion_tokens
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens


def test_metrics_follow_the_requests(server, client):
    before = metrics(server)
    assert before["jaxtrain_kv_pages_total"] > 0 and before["jaxtrain_engine_alive"] == 1
    out = client.completions.create(
        model="tiny", prompt="import", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 7
    httpx.get(f"{server}/models")  # a 401
    after = metrics(server)
    ok, denied = 'jaxtrain_requests_total{status="200"}', 'jaxtrain_requests_total{status="401"}'
    assert after["jaxtrain_generated_tokens_total"] - before["jaxtrain_generated_tokens_total"] == 7
    assert after[ok] - before.get(ok, 0) == 1  # the scrapes are not counted
    assert after[denied] - before.get(denied, 0) == 1
    ttft, itl = "jaxtrain_time_to_first_token_seconds", "jaxtrain_inter_token_latency_seconds"
    assert after[f"{ttft}_count"] - before[f"{ttft}_count"] == 1
    assert after[f"{itl}_count"] - before[f"{itl}_count"] == 6
    assert after[f'{ttft}_bucket{{le="+Inf"}}'] == after[f"{ttft}_count"]
    assert after[f"{ttft}_sum"] > before[f"{ttft}_sum"]
    assert after["jaxtrain_running_sequences"] == 0 and after["jaxtrain_kv_pages_used"] == 0
    parser = pytest.importorskip("prometheus_client.parser")  # an independent reader
    text = httpx.get(server.removesuffix("/v1") + "/metrics", headers=AUTH).text
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["jaxtrain_time_to_first_token_seconds"].type == "histogram"
    assert families["jaxtrain_generated_tokens"].type == "counter"


def _hold_stream(server: str, body: dict, started: threading.Event, stop: threading.Event):
    """Stream `body` until `stop` is set, then go away (the server cancels the request)."""
    with httpx.stream("POST", f"{server}/completions", headers=AUTH, json=body, timeout=120) as s:
        for _ in s.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_a_full_queue_answers_429_with_retry_after(server, client):
    """Two slots decoding, one request waiting (max_queue 1): the next gets 429."""
    long = {"model": "tiny", "prompt": "def", "max_tokens": 900, "stream": True,
            "ignore_eos": True}  # fmt: skip
    stop, waiters = threading.Event(), []
    for _ in range(2):  # both slots
        started = threading.Event()
        thread = threading.Thread(target=_hold_stream, args=(server, long, started, stop))
        thread.start()
        assert started.wait(120)
        waiters.append(thread)
    queued: list[httpx.Response] = []
    third = threading.Thread(
        target=lambda: queued.append(
            _post(server, {"model": "tiny", "prompt": "x", "max_tokens": 2})
        )
    )
    third.start()
    deadline = time.monotonic() + 30
    while metrics(server)["jaxtrain_queue_depth"] < 1:
        assert time.monotonic() < deadline, "the third request never waited"
        # A skip here would let the 429 go untested: the long requests must still decode.
        assert any(t.is_alive() for t in waiters), "the long requests ended before the queue filled"
        time.sleep(0.05)
    answer = _post(server, {"model": "tiny", "prompt": "y", "max_tokens": 2})
    assert answer.status_code == 429, answer.text
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="y", max_tokens=2)
    stop.set()
    for thread in waiters:
        thread.join(60)
    third.join(120)
    assert queued and queued[0].status_code == 200  # served once the slots freed
    deadline = time.monotonic() + 30
    while metrics(server)["jaxtrain_running_sequences"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metrics(server)["jaxtrain_kv_pages_used"] == 0


def test_no_key_off_loopback_is_refused_in_one_line(long_model_dir, monkeypatch, capsys):
    from jaxtrain.cli import main
    from jaxtrain.cli.serve import is_loopback, parse_serve_options

    monkeypatch.delenv("JAXTRAIN_API_KEY", raising=False)
    assert main(["serve", str(long_model_dir), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--api_key" in err and "0.0.0.0" in err
    _, options = parse_serve_options(
        [str(long_model_dir), "--host", "0.0.0.0", "--allow_unauthenticated", "true"]
    )
    assert options["api_key"] is None
    _, options = parse_serve_options([str(long_model_dir), "--host", "::", "--api_key", "k"])
    assert options["api_key"] == "k"
    monkeypatch.setenv("JAXTRAIN_API_KEY", "from-env")
    assert (
        parse_serve_options([str(long_model_dir), "--host", "10.0.0.1"])[1]["api_key"] == "from-env"
    )
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.4", "example.com"]))
    with pytest.raises(Exception, match="max_stop must be >= 0"):
        from jaxtrain.cli.serve import serve_limits

        serve_limits(parse_serve_options([str(long_model_dir), "--max_stop", "-1"])[1])


def test_a_bad_or_taken_port_is_refused_before_the_model_loads(tmp_path, capsys):
    """`--port 99999` was served on 99999 - 65536; a taken port was found after the whole
    warm-up (minutes), as uvicorn's error and exit 3. No model is read here: the directory
    does not exist, and the port is what the one line names."""
    import socket

    from jaxtrain.cli import main

    missing = str(tmp_path / "no_model")
    assert main(["serve", missing, "--port", "99999"]) == 2
    assert "--port must be at most 65535, got 99999" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", missing, "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--port {port}: cannot listen there" in err
    # Each error names the command once.
    assert main(["serve", missing, "--request_timeout", "-1"]) == 2
    assert capsys.readouterr().err.count("jaxtrain serve") == 1


def test_logprobs_in_openai_s_shapes_are_the_model_s(server, client, long_model_dir, tokenizer):
    import jax
    import numpy as np

    from jaxtrain.hf import AutoModelForCausalLM

    prompt = "def add(a, b):"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = out.choices[0]
    tokens = choice.model_extra["token_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(tokens) == 6
    assert all(1 <= len(alts) <= 3 for alts in lp.top_logprobs)  # keyed by text: ids may share one
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The training code's view: log_softmax of the model's logits over prompt + completion.
    model = AutoModelForCausalLM.from_pretrained(long_model_dir)
    ids = out.model_extra["prompt_token_ids"] + tokens
    logits = np.asarray(model(np.asarray([ids]))[0], np.float32)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    start = len(out.model_extra["prompt_token_ids"]) - 1
    want = [logp[start + i, t] for i, t in enumerate(tokens)]
    np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)
    for i, alts in enumerate(lp.top_logprobs):  # greedy: the chosen token is the best
        assert max(alts.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    pieces = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            logprobs=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    )
    streamed = [
        v for p in pieces if p.choices[0].logprobs for v in p.choices[0].logprobs.token_logprobs
    ]
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=1e-6)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert plain.choices[0].logprobs is None

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "fox"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 5
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert content[0].bytes == list(content[0].token.encode())
    answer = _post(server, {"model": "tiny", "prompt": "x", "logprobs": 21})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logprobs"
    answer = httpx.post(
        f"{server}/chat/completions", headers=AUTH, timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    )  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "top_logprobs"

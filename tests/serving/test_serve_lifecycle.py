"""A request's end and the server's: the request timeout (in-process, where the engine's slots
and pages can be looked at) and SIGTERM's drain (a real `jaxtrain serve` process)."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

openai = pytest.importorskip("openai")


def _wait_until_free(engine, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not engine.idle:
        assert time.monotonic() < deadline, "the engine still holds the request"
        time.sleep(0.02)
    assert engine.pages.available == engine.pages.num_pages - 1  # every page back


def test_a_request_past_the_timeout_is_cancelled_and_its_pages_freed(long_model_dir, free_port):
    import uvicorn

    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.serving import Engine
    from jaxtrain.serving.limits import ServeLimits
    from jaxtrain.serving.server import create_app

    model, tokenizer, _ = load_served_model(long_model_dir)
    engine = Engine(model, tokenizer=tokenizer, max_slots=2, eos_token_ids=[])
    # 0.3 s: well under what 1000 decode steps take (at least ~1 ms each, host work alone; at
    # 1 s a warm engine once finished the third request in time).
    limits = ServeLimits(request_timeout=0.3)
    app = create_app(engine, model_name="tiny", tokenizer=tokenizer, limits=limits)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    long = {"model": "tiny", "prompt": "def", "max_tokens": 1000}
    try:
        while not server.started:
            time.sleep(0.05)
        began = time.monotonic()
        answer = httpx.post(url, json=long, timeout=60)
        assert answer.status_code == 504, answer.text
        assert answer.json()["error"]["code"] == "timeout"
        assert 0.3 <= time.monotonic() - began < 20
        _wait_until_free(engine)

        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as stream:
            assert stream.status_code == 200  # sent with the first event
            lines = [line for line in stream.iter_lines() if line]
        assert len(lines) > 1 and "data: [DONE]" not in lines  # tokens, then the error
        assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "timeout"
        _wait_until_free(engine)

        client = openai.OpenAI(
            base_url=url.removesuffix("/completions"), api_key="-", max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model="tiny", prompt="def", max_tokens=1000)
        assert caught.value.status_code == 504
        _wait_until_free(engine)
        short = client.completions.create(model="tiny", prompt="def", max_tokens=3)
        assert short.usage.completion_tokens == 3  # the server goes on serving
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "jaxtrain_request_timeouts_total 3" in text.splitlines()
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_sigterm_finishes_the_running_stream_refuses_new_requests_and_exits_0(
    long_model_dir, spawn_server
):
    process, base = spawn_server(long_model_dir, "--model_name", "tiny")
    body = {"model": "tiny", "prompt": "def", "max_tokens": 800, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as stream:
            for line in stream.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=read)
    try:
        reader.start()
        assert started.wait(120)
        process.send_signal(signal.SIGTERM)
        # New requests are answered 503 (the signal lands within moments) while it drains.
        deadline = time.monotonic() + 10
        while True:
            answer = httpx.post(f"{base}/completions", json={"model": "tiny", "prompt": "x"})
            if answer.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert answer.status_code == 503 and reader.is_alive(), answer.text
        assert answer.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(base.removesuffix("/v1") + "/health")
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        # A scrape still sees the server while it drains (it was refused 503 like a request).
        scrape = httpx.get(base.removesuffix("/v1") + "/metrics")
        assert scrape.status_code == 200 and "jaxtrain_running_sequences" in scrape.text
        reader.join(120)
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 800  # the running stream was finished
        assert process.wait(timeout=60) == 0
        assert "SIGTERM: finishing the requests in flight" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
        reader.join(5)


def test_preempted_requests_finish_whole_and_metrics_count_them(model_dir, free_port):
    """A KV pool too small for four long requests at once: the engine preempts and later
    recomputes the youngest; every answer, streamed or not, still has exactly the greedy
    tokens of `generate` (a stream repeats none of them), /metrics' preemption counter is the
    engine's, and every page comes back."""
    import uvicorn

    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.models import generate
    from jaxtrain.serving import Engine
    from jaxtrain.serving.server import create_app

    model, tokenizer, _ = load_served_model(model_dir)
    # 7 pages of 16 tokens: one sequence of 83 tokens needs 6 of them, four need 24.
    engine = Engine(model, tokenizer=tokenizer, max_slots=4, num_pages=8, eos_token_ids=[])
    app = create_app(engine, model_name="tiny", tokenizer=tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15]]
    want = [generate(model, p, max_new_tokens=80, eos_token_id=None).tolist() for p in prompts]

    def ask(i: int) -> list[int]:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 80, "temperature": 0,
                "return_token_ids": True, "stream": bool(i % 2)}  # fmt: skip
        if not i % 2:
            answer = httpx.post(url, json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["token_ids"]
        ids = []
        with httpx.stream("POST", url, json=body, timeout=120) as stream:
            assert stream.status_code == 200
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"]
        return ids

    try:
        while not server.started:
            time.sleep(0.05)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        assert got == want
        assert engine.preemptions > 0
        _wait_until_free(engine)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
        assert f"jaxtrain_preemptions_total {engine.preemptions}" in text
        assert "jaxtrain_kv_pages_used 0" in text
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_a_restarted_server_loads_its_warm_up_from_the_compilation_cache(
    model_dir, spawn_server, tmp_path
):
    """The warm-up's programs go to --compilation_cache_dir; a second start finds every one
    there and writes none (JAX keys a program by its HLO and flags: a miss would be a new
    entry). Every program is kept (minimum compile time 0), none of the suite's cache."""
    cache = tmp_path / "xla"
    env = {"JAX_COMPILATION_CACHE_DIR": "", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    options = ("--warm_up", "true", "--max_slots", "2", "--max_length", "48", "--model_name",
               "tiny", "--max_prompt_tokens", "16", "--compilation_cache_dir", str(cache))  # fmt: skip
    entries = []
    for _ in range(2):
        process, base = spawn_server(model_dir, *options, env=env)
        try:
            reply = httpx.post(f"{base}/completions", timeout=60,
                               json={"model": "tiny", "prompt": "def", "max_tokens": 3})  # fmt: skip
            assert reply.status_code == 200, reply.text
        finally:
            process.terminate()
            output = process.communicate(timeout=60)[0]
        assert "compiled" in output, output[-2000:]
        entries.append(sorted(p.name for p in cache.iterdir()))
    assert len(entries[0]) >= 4, entries[0]  # the prefill and decode buckets, and more
    assert entries[1] == entries[0]

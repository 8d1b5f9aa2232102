"""The campaign's grpo stage (bench/accelerator.py): GRPO steps of the size's random model,
synchronous and a round ahead, with a word-level tokenizer and random prompts, so nothing is
downloaded on the device machine. Run by bench/accelerator_stages.py."""

from __future__ import annotations

import tempfile
import time

import numpy as np
from accelerator_stages import MODELS, model_config

# GRPO runs: completions per step, per prompt, prompt and completion tokens, steps (the
# first `warmup` excluded from the time per step).
GRPO_RUNS = {
    "1b": dict(batch=64, group=4, prompt=64, new=128, steps=8, warmup=2),
    "tiny": dict(batch=4, group=2, prompt=8, new=8, steps=4, warmup=1),
}


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of `vocab_size` ids ("w0", "w1", ...): text for a random model's
    GRPO run without a tokenizer file (the device machine has none to download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(vocab_size - 3)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def distinct_words(prompts, completions, **_) -> list[float]:
    """The share of a completion's words that differ: a reward with spread, for timing."""
    return [len(set(c.split())) / max(len(c.split()), 1) for c in completions]


def grpo_step(size: str, max_staleness: int, decode_steps: int = 1) -> dict:
    """Seconds per GRPO step (full fine-tuning of the size's random model, bf16 compute, the
    serving engine sampling `decode_steps` tokens per call) synchronous (max_staleness 0) or
    a round ahead (1): issue 47's figure on the accelerator."""
    from jaxtrain.trainers import GRPOArguments, GRPOTrainer

    run, vocab = GRPO_RUNS[size], MODELS[size]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = run["steps"] * run["batch"] // run["group"]
    rows = [{"prompt": " ".join(f"w{t}" for t in rng.integers(0, vocab - 3, run["prompt"]))}
            for _ in range(prompts)]  # fmt: skip
    times, logs = [], []

    class Clock:
        def on_log(self, trainer, values, step) -> None:
            times.append(time.perf_counter())
            logs.append(dict(values))
            # Each step in the stage's log as it ends: a stage stopped at its budget still
            # says how far it got and where its time went.
            timings = {k: round(v, 3) for k, v in values.items() if k.endswith("_s")}
            print(f"grpo step {step}: {times[-1] - start:.1f} s in, {timings}", flush=True)

    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="jaxtrain-accel-grpo-") as out_dir:
        args = GRPOArguments(
            output_dir=out_dir, max_steps=run["steps"], total_batch_size=run["batch"],
            num_generations=run["group"], max_prompt_length=run["prompt"],
            max_completion_length=run["new"], temperature=1.0, beta=0.0, learning_rate=1e-5,
            warmup_steps=0, logging_steps=1, evaluation_strategy="no", save_final=False,
            progress_bar="none", run_report=False, seed=0, dtype="bfloat16",
            max_staleness=max_staleness, rollout_decode_steps=decode_steps,
            compilation_cache_dir=None,
        )  # fmt: skip
        start = time.perf_counter()
        GRPOTrainer(
            arguments=args,
            model=LlamaForCausalLM(model_config(size), rngs=nnx.Rngs(0)),
            reward_funcs=[distinct_words],
            dataset_train=rows,
            processing_class=word_tokenizer(vocab),
            callbacks=[Clock()],
        ).train()
        wall = time.perf_counter() - start
    steady = times[run["warmup"] :]
    handoff = [x["async/weight_handoff_s"] for x in logs if "async/weight_handoff_s" in x]
    return {
        "max_staleness": max_staleness,
        "decode_steps": decode_steps,
        **run,
        "steady_steps": f"{run['warmup'] + 2}-{run['steps']}",
        "step_s": (steady[-1] - steady[0]) / (len(steady) - 1),
        "first_steps_s": times[run["warmup"]] - start,
        "reward_first": logs[0]["reward"],
        "reward_last": logs[-1]["reward"],
        "weight_handoff_s": float(np.median(handoff)) if handoff else None,
        "wall_s": wall,
    }

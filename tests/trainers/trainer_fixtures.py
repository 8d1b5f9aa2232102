"""The task-trainer tests' helpers: tiny Llama models and their arguments, a synthetic
preference set (right answers chosen, wrong rejected), the word list and chat template of the
tokenizer fixture (conftest.py), and a callback that keeps every step's metrics.

A module of its own, not conftest.py: `from conftest import ...` finds whichever conftest.py
was imported first, so a run of tests/serving and tests/trainers together failed to import.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flax import nnx

from jaxtrain import TrainingArguments
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.rollout_arguments import RolloutArguments

WORDS = [str(i) for i in range(20)] + ["+", "=", "user", "assistant", "what", "is", "?"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant : {% endif %}"
)
VOCAB = 64


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        eos_token_id=3,
    )
    return LlamaConfig(**{**values, **overrides})


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(tiny_config(**overrides), rngs=nnx.Rngs(seed))


def addition_pairs(n: int = 16) -> list[dict[str, str]]:
    """'what is a + b ?' -> chosen: the sum, rejected: a wrong sum."""
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        rows.append(
            {
                "prompt": f"what is {a} + {b} ?",
                "chosen": f"{a + b}",
                "rejected": f"{(a + b + 1 + i % 3) % 20}",
            }
        )
    return rows


def tiny_arguments(cls=TrainingArguments, tmp_path=None, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run") if tmp_path is not None else "runs/test",
        max_steps=4,
        total_batch_size=8,
        max_sequence_length=16,
        learning_rate=1e-2,
        warmup_steps=0,
        logging_steps=1,
        progress_bar="none",
        save_final=False,
        run_report=False,
    )
    if issubclass(cls, RolloutArguments):
        # Each engine shape compiles when a round first reaches it, not all before the first
        # round: what a warm-up adds is tested in test_grpo_compiles.py.
        values["rollout_warm_up"] = False
    return cls(**{**values, **overrides})


class StepMetrics:
    """A callback keeping every step's device metrics (all sums of the objective)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_step_end(self, trainer, state, metrics, step) -> None:
        self.steps.append({k: float(v) for k, v in metrics.items()})

"""GRPO compiles its old-log-prob pass and its train step once each over a run of several
steps (fixed shapes), and the engine's steps once per bucketed shape, all of them before the
first round samples (nothing compiles after the first step), counted from JAX's own compile
log and the run's metrics.jsonl."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter

import jax
from test_grpo import big_first_number, grpo_args, prompts
from trainer_fixtures import tiny_model

from jaxtrain.trainers import GRPOTrainer


class Steps:
    """Which step each compile happened in (the step that was running when JAX logged it)."""

    def __init__(self):
        self.step = 0

    def on_step_end(self, trainer, state, metrics, step):
        self.step = step


def test_generation_and_the_train_step_compile_once_over_several_steps(tokenizer, tmp_path, caplog):
    steps = Steps()
    args = grpo_args(tmp_path, max_steps=6, num_iterations=2, beta=0.04, report_to="jsonl")
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[steps],
    )
    compiled: Counter[str] = Counter()
    after_first: list[str] = []

    class Record(logging.Handler):
        def emit(self, record):
            # Logged for every executable JAX builds, persistent-cache hits included.
            found = re.match(r"Compiling (?:jit\()?([\w.<>]+)", record.getMessage())
            if found:
                compiled[found.group(1)] += 1
                if steps.step >= 1:
                    after_first.append(found.group(1))

    jax.clear_caches()  # earlier tests of this process may have compiled the same shapes
    handler = Record(level=logging.DEBUG)
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            trainer.train()
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert steps.step == 6
    shapes = trainer.train_source.engine.steps.compiles  # 3 generation rounds
    assert compiled["_prefill_fn"] == len(shapes["prefill"]), compiled  # once per bucket
    assert compiled["_decode_fn"] == len(shapes["decode"]), compiled
    assert compiled["trainer_logps"] == 1, compiled  # the sampling policy's log-probs
    assert compiled["train_step"] == 1, compiled
    # The engine compiled every bucket before its first round sampled: nothing after.
    assert after_first == [], after_first
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    counts = [r["compile/train_step_count"] for r in records if "compile/train_step_count" in r]
    assert counts == [1]  # the monitor's record: one compile of the step, no recompile

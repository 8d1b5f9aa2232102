"""GRPO compiles its old-log-prob pass and its train step once each over a run of several
steps (fixed shapes), and the engine's steps once per bucketed shape, all of them before the
first round samples (nothing compiles after the first step), counted from JAX's own compile
log and the run's metrics.jsonl. With `rollout_warm_up=False`, and by default in a run of one
round, the engine compiles only the shapes its rounds reach."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter

import jax
import pytest
from test_grpo import big_first_number, grpo_args, prompts
from trainer_fixtures import tiny_model

from jaxtrain.config.sections import RunSettings
from jaxtrain.serving.warm_up import step_calls
from jaxtrain.trainers import GRPOTrainer
from jaxtrain.trainers.grpo_sampler import rollout_engine_shape, warms_up


class Steps:
    """Which step each compile happened in (the step that was running when JAX logged it)."""

    def __init__(self):
        self.step = 0

    def on_step_end(self, trainer, state, metrics, step):
        self.step = step


def _trainer(tokenizer, args, steps: Steps) -> GRPOTrainer:
    return GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[steps],
    )


def _train_logging_compiles(trainer: GRPOTrainer, steps: Steps) -> tuple[Counter, list[str]]:
    """(programs compiled, by name; those compiled after the first step) of a run."""
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
    return compiled, after_first


def test_generation_and_the_train_step_compile_once_over_several_steps(tokenizer, tmp_path):
    steps = Steps()
    # rollout_warm_up's default (None): 3 rounds, so the engine warms up.
    args = grpo_args(
        tmp_path, max_steps=6, num_iterations=2, beta=0.04, report_to="jsonl", rollout_warm_up=None
    )
    trainer = _trainer(tokenizer, args, steps)
    compiled, after_first = _train_logging_compiles(trainer, steps)
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


def test_the_default_warms_up_unless_the_run_trains_one_round():
    def chosen(**fields) -> bool:
        return warms_up(RunSettings.from_arguments(grpo_args(None, **fields)))

    assert chosen(rollout_warm_up=None, max_steps=3) is True
    assert chosen(rollout_warm_up=None, max_steps=-1, num_train_epochs=1) is True  # by epochs
    assert chosen(rollout_warm_up=None, max_steps=1) is False
    assert chosen(rollout_warm_up=None, max_steps=2, num_iterations=2) is False
    assert chosen(rollout_warm_up=True, max_steps=1) is True  # an explicit choice wins
    assert chosen(rollout_warm_up=False, max_steps=6) is False


@pytest.mark.parametrize(
    "fields",
    [
        dict(max_steps=2, rollout_warm_up=False),  # turned off: two rounds
        dict(max_steps=2, num_iterations=2, rollout_warm_up=None),  # the default, one round
    ],
    ids=["off", "one_round"],
)
def test_without_warm_up_the_engine_compiles_only_the_shapes_its_rounds_reach(
    tokenizer, tmp_path, fields
):
    steps = Steps()
    args = grpo_args(tmp_path, **fields)
    trainer = _trainer(tokenizer, args, steps)
    compiled, _ = _train_logging_compiles(trainer, steps)
    assert steps.step == 2
    source = trainer.train_source
    shapes = source.engine.steps.compiles
    assert compiled["_prefill_fn"] == len(shapes["prefill"]), compiled
    assert compiled["_decode_fn"] == len(shapes["decode"]), compiled
    # A warm-up would have compiled every shape the prompts can reach: more than the run did.
    shape = rollout_engine_shape(trainer.settings)
    reachable = Counter(kind for kind, _ in step_calls(shape, *source.sampler._warm_up_limits()))
    used = {kind: len(shapes[kind]) for kind in ("prefill", "decode")}
    assert used["prefill"] <= reachable["prefill"] and used["decode"] < reachable["decode"], (
        used,
        reachable,
    )

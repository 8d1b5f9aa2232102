"""DAPO's dynamic sampling: the groups whose rewards are all equal (the odd prompts here: a
constant reward) are replaced by groups of other prompts, so every round trains on groups
with a signal; the replacements are a function of the seed and the round (a resumed run
draws the same), and bad settings are refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from trainer_fixtures import tiny_arguments, tiny_model

from jaxtrain.arguments import ArgumentError
from jaxtrain.trainers import GRPOArguments, GRPOTrainer

PROMPTS = [{"prompt": f"what is {i} + 1 ?", "number": i} for i in range(20)]


def odd_prompts_are_constant(prompts, completions, number, **_):
    """Odd prompts: 0.5 whatever the completion (no signal); even: the completion's length."""
    return [0.5 if n % 2 else float(len(c.split())) for c, n in zip(completions, number)]


class Rounds:
    def __init__(self):
        self.logs, self.prompts = [], []

    def on_log(self, trainer, logs, step):
        self.logs.append(dict(logs))

    def on_step_end(self, trainer, state, metrics, step):
        ids = trainer.train_source._round.host["input_ids"].reshape(-1, 12)[::4]
        # The prompt's number of each group ("what is N + 1 ?", left-aligned in the row).
        words = [trainer.processing_class.decode(row).split() for row in ids]
        self.prompts.append([int(w[w.index("is") + 1]) for w in words])


class StopAt:
    def on_step_end(self, trainer, state, metrics, step):
        trainer.should_stop = step == 2


def run(tokenizer, tmp_path, name, passes, stop=False, **extra):
    rounds = Rounds()
    args = tiny_arguments(
        GRPOArguments, tmp_path / name, max_steps=3, total_batch_size=16,
        num_generations=4, max_prompt_length=8, max_completion_length=4, temperature=1.0,
        logging_steps=1, dynamic_sampling_passes=passes, learning_rate=1e-2, seed=3, **extra,
    )  # fmt: skip
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[odd_prompts_are_constant],
        dataset_train=PROMPTS,
        processing_class=tokenizer,
        callbacks=[rounds, StopAt()] if stop else [rounds],
    )
    output = trainer.train()
    return rounds, output


def test_equal_groups_are_replaced_by_groups_with_a_signal(tokenizer, tmp_path):
    plain, _ = run(tokenizer, tmp_path, "plain", passes=0)
    dynamic, output = run(tokenizer, tmp_path, "dynamic", passes=4)
    # Without it, odd prompts' groups train with advantage 0; with it, none is left.
    assert any(x["frac_reward_zero_std"] > 0 for x in plain.logs)
    assert any(n % 2 for group in plain.prompts for n in group)
    for logs, prompts in zip(dynamic.logs, dynamic.prompts):
        assert logs["frac_reward_zero_std"] == 0.0, (logs, prompts)
        assert all(n % 2 == 0 for n in prompts), prompts  # the replacements are even prompts
        assert len(set(prompts)) == len(prompts)  # a prompt is used once per round
    assert sum(x["dynamic_sampling/replaced_groups"] for x in dynamic.logs) > 0
    for x in dynamic.logs:  # a pass is made only when some group needs replacing
        assert (x["dynamic_sampling/passes"] > 0) == (x["dynamic_sampling/replaced_groups"] > 0)
    # Deterministic: a run resumed at step 2 draws and trains what the whole run did.
    run(tokenizer, tmp_path, "resumed", passes=4, stop=True, save_final=True)
    again, resumed = run(tokenizer, tmp_path, "resumed", passes=4, resume_if_possible=True)
    assert again.prompts == dynamic.prompts[2:]
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(output.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("value", [-1, 1.5])
def test_a_bad_pass_count_is_refused(tmp_path, value):
    with pytest.raises(ArgumentError, match="dynamic_sampling_passes"):
        GRPOArguments(output_dir=str(tmp_path), dynamic_sampling_passes=value)

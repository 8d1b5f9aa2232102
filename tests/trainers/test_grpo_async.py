"""Asynchronous GRPO (max_staleness): the next round is sampled in the background from the
parameters of its time; its batch carries that policy's log-probs and the update is the
off-policy one they give; a checkpoint keeps the rounds in flight, so a resume is exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_grpo import Completions, big_first_number, grpo_args, prompts, run
from trainer_fixtures import tiny_model

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import RunSettings
from jaxtrain.trainers import GRPOTrainer
from jaxtrain.trainers.grpo import check_process_groups, grpo_objective, split_rollout_devices
from jaxtrain.training.logps import model_token_logps


class Rounds(Completions):
    """Also each step's batch and the parameters it was applied to."""

    def __init__(self):
        super().__init__()
        self.batches, self.params = [], {}

    def on_batch(self, trainer, batch, step):
        self.batches.append(jax.device_get(batch))  # the i-th step's at [i - 1]

    def on_step_end(self, trainer, state, metrics, step):
        super().on_step_end(trainer, state, metrics, step)
        self.params[step] = jax.device_get(state.params)


def test_k1_trains_on_the_previous_policy_s_completions_off_policy(tokenizer, tmp_path):
    sync, ahead = Completions(), Rounds()
    settings = dict(max_steps=3, num_iterations=1, beta=0.04, save_steps=None)
    run(tokenizer, tmp_path / "sync", sync, **settings)
    trainer_args = grpo_args(tmp_path / "async", max_staleness=1, **settings)
    trainer = GRPOTrainer(
        arguments=trainer_args, model=tiny_model(), reward_funcs=[big_first_number],
        dataset_train=prompts(), processing_class=tokenizer, callbacks=[ahead],
    )  # fmt: skip
    trainer.train()
    # The first round is sampled from the first parameters in both runs.
    assert ahead.by_step[1] == sync.by_step[1]
    assert ahead.logs[1]["reward"] == sync.logs[1]["reward"]
    assert ahead.logs[1]["loss"] == pytest.approx(sync.logs[1]["loss"], abs=1e-6)
    assert ahead.logs[1]["grad_norm"] == pytest.approx(sync.logs[1]["grad_norm"], rel=1e-4)
    assert [ahead.logs[s]["async/staleness"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all("async/weight_handoff_s" in ahead.logs[s] for s in (1, 2))

    # Round 2 was sampled from the first parameters: its old log-probs are theirs.
    batch = {k: jnp.asarray(v[0]) for k, v in ahead.batches[1].items()}
    first = tiny_model()
    old, mask = model_token_logps(first, batch["input_ids"], batch["labels"])
    np.testing.assert_allclose(
        np.asarray(batch["old_logps"]) * np.asarray(mask), np.asarray(old), rtol=1e-5, atol=1e-6
    )
    # Its update is the off-policy one: the loss of the parameters after step 1 against them.
    program = trainer.program
    objective = grpo_objective(RunSettings.from_arguments(trainer_args))
    params = jax.tree.map(jnp.asarray, ahead.params[1])

    def loss(micro):
        sums = objective.loss_sums(nnx.merge(program.graphdef, params, program.rest), micro, None)
        return float(
            sums["loss_sum"] / objective.normalizer(jax.tree.map(lambda x: x[None], micro))
        )

    assert ahead.logs[2]["loss"] == pytest.approx(loss(batch), rel=1e-5)
    on_policy = {k: v for k, v in batch.items() if k != "old_logps"}
    assert loss(on_policy) != pytest.approx(loss(batch), rel=1e-3)  # the lag is corrected


def test_async_resume_is_exact(tokenizer, tmp_path):
    """Killed after step 5 (last save: step 4, a round boundary with the next round in
    flight), resumed: the rounds in flight were saved, so the same completions and logs from
    there on as the uninterrupted run, and bit-equal parameters at the end."""
    args = dict(max_staleness=1)
    whole, part, rest = Completions(), Completions(stop_after=5), Completions()
    full = run(tokenizer, tmp_path / "a", whole, **args)
    assert (tmp_path / "a" / "run" / "checkpoints" / "4" / "extra").is_dir()
    run(tokenizer, tmp_path / "b", part, **args)
    resumed = run(tokenizer, tmp_path / "b", rest, **args)
    assert sorted(rest.by_step) == [5, 6, 7, 8]
    for step in rest.by_step:
        assert rest.by_step[step] == whole.by_step[step], step
        assert rest.logs[step]["loss"] == whole.logs[step]["loss"], step
    for a, b in zip(full, resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_async_runs_in_one_process_and_checks_its_bound(tmp_path):
    with pytest.raises(ArgumentError, match="asynchronous rollouts run in one process"):
        check_process_groups(
            RunSettings.from_arguments(grpo_args(tmp_path, max_staleness=1, total_batch_size=16)), 2
        )
    with pytest.raises(ArgumentError, match="max_staleness=-1 must be an integer >= 0"):
        grpo_args(tmp_path, max_staleness=-1)
    one = {"devices": jax.devices()[:1]}
    with pytest.raises(ArgumentError, match="rollout_devices=1 leaves no device to train on"):
        split_rollout_devices(
            RunSettings.from_arguments(grpo_args(tmp_path, rollout_devices=1)), one
        )
    assert split_rollout_devices(RunSettings.from_arguments(grpo_args(tmp_path)), one) == (
        None,
        None,
    )


def test_a_failed_round_is_raised_when_taken_and_said_when_dropped(caplog):
    """A round sampled ahead whose sampling failed (a reward function raised) raises when the
    run reaches it; dropped at the run's end (it stopped first), it is logged, not lost."""
    import logging
    import types

    from jaxtrain.trainers.rounds_ahead import RoundsAhead

    def broken(state, generation, launched_at):
        raise ValueError(f"the reward broke in round {generation}")

    state = types.SimpleNamespace(params={"w": jnp.zeros(2)})
    taken = RoundsAhead(broken, max_staleness=1, last_generation=None)
    taken.launch(state, 0)
    with pytest.raises(ValueError, match="round 1"):
        taken.take(1)
    taken.close()
    dropped = RoundsAhead(broken, max_staleness=1, last_generation=None)
    dropped.launch(state, 0)
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        dropped.close()
    assert "round 1, sampled ahead and never trained" in caplog.text
    assert "the reward broke in round 1" in caplog.text

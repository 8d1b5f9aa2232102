"""A task trainer has one objective, however it is stated: its public `compute_loss_sums` is
the task's loss (DPOTrainer's was once the base causal LM loss, which failed on its own task
model), and a subclass's `compute_loss_sums` replaces the task's (it was once ignored)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model

from jaxtrain.trainers import DPOArguments, DPOTrainer
from jaxtrain.trainers.dpo import dpo_objective


def pair_batch(seed: int = 0, rows: int = 4, length: int = 12) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    batch = {}
    for prefix in ("", "rejected_"):
        ids = rng.integers(5, 64, (rows, length))
        labels = np.where(np.arange(length) >= 5, ids, -100)  # the prompt's 5 tokens: no loss
        batch[f"{prefix}input_ids"] = jnp.asarray(ids, jnp.int32)
        batch[f"{prefix}labels"] = jnp.asarray(labels, jnp.int32)
        batch[f"{prefix}attention_mask"] = jnp.ones((rows, length), jnp.int32)
    return batch


class DoubledDPO(DPOTrainer):
    def compute_loss_sums(self, model, batch, rng):
        sums = dict(super().compute_loss_sums(model, batch, rng))
        sums["loss_sum"] = 2 * sums["loss_sum"]
        return sums


def make(cls, tokenizer, tmp_path, metrics):
    args = tiny_arguments(DPOArguments, tmp_path, max_steps=1, beta=0.1)
    return cls(
        arguments=args, model=tiny_model(), dataset_train=addition_pairs(),
        processing_class=tokenizer, callbacks=[metrics],
    )  # fmt: skip


def test_dpo_compute_loss_sums_is_dpo_s_and_a_subclass_s_replaces_it(tokenizer, tmp_path):
    metrics = StepMetrics()
    trainer = make(DPOTrainer, tokenizer, tmp_path / "dpo", metrics)
    batch, rng = pair_batch(), jax.random.key(0)
    ours = trainer.compute_loss_sums(trainer.model, batch, rng)
    want = dpo_objective(trainer.settings).loss_sums(trainer.model, batch, rng)
    assert set(ours) == set(want) and "rewards/margins_sum" in ours
    for key in want:
        np.testing.assert_array_equal(np.asarray(ours[key]), np.asarray(want[key]))
    trainer.train()

    doubled = StepMetrics()
    make(DoubledDPO, tokenizer, tmp_path / "doubled", doubled).train()
    # Same pairs, same parameters: the subclass's loss is the one the step minimised.
    first, twice = metrics.steps[0], doubled.steps[0]
    assert twice["loss_sum"] == pytest.approx(2 * first["loss_sum"], rel=1e-6)
    assert twice["tokens"] == first["tokens"]

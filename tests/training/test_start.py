"""train() compiles its step against the state's shapes while the state is built: the
program it compiled is the one every step runs (one compile), whatever builds the state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_run import tiny_arguments, tiny_model, tiny_trainer, token_dataset

from jaxtrain import Trainer
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.parallel import ModelFactory
from jaxtrain.training.optim import OPTIMIZERS


def train_step_compiles(output_dir) -> list[dict]:
    records = read_jsonl(output_dir / "metrics.jsonl")
    return [r for r in records if "compile/train_step_s" in r]


@pytest.mark.parametrize(
    "setup",
    [*(dict(optimizer=name) for name in OPTIMIZERS), dict(lora_rank=4), dict(factory=True)],
    ids=[*OPTIMIZERS, "lora", "model_factory"],
)
def test_the_step_compiled_beside_the_state_build_is_the_one_that_runs(tmp_path, setup):
    setup = dict(setup)
    model = ModelFactory(tiny_model) if setup.pop("factory", False) else tiny_model()
    trainer = tiny_trainer(str(tmp_path), model=model, max_steps=3, **setup)
    output = trainer.train()
    assert int(output.state.step) == 3
    compiles = train_step_compiles(tmp_path)
    assert [r["compile/train_step_count"] for r in compiles] == [1]


class WeakScalarOptimizer(Trainer):
    """An optimizer whose state holds a weakly typed scalar (`jnp.asarray(1.0)`)."""

    def create_optimizer(self, total_steps):
        optimizer, schedule = super().create_optimizer(total_steps)
        scale = optax.GradientTransformation(
            init=lambda params: {"factor": jnp.asarray(1.0)},
            update=lambda updates, state, params=None: (
                jax.tree.map(lambda u: u * state["factor"], updates),
                state,
            ),
        )
        return optax.chain(optimizer, scale), schedule


def test_a_weakly_typed_optimizer_state_compiles_once(tmp_path):
    trainer = WeakScalarOptimizer(
        arguments=tiny_arguments(str(tmp_path), max_steps=2),
        model=tiny_model(),
        dataset_train=token_dataset(),
    )
    assert trainer.program.abstract_state().opt_state[1]["factor"].weak_type
    trainer.train()
    assert [r["compile/train_step_count"] for r in train_step_compiles(tmp_path)] == [1]


def test_a_resume_with_a_new_optimizer_state_runs_the_step_compiled_beside_it(tmp_path):
    tiny_trainer(str(tmp_path), max_steps=2).train()  # saves its final step
    resumed = tiny_trainer(str(tmp_path), max_steps=4, optimizer="lion", reset_optimizer=True)
    output = resumed.train()
    assert int(output.state.step) == 4
    # The log holds each run's compile: one each.
    assert [r["compile/train_step_count"] for r in train_step_compiles(tmp_path)] == [1, 1]


class BrokenObjective(Trainer):
    def compute_loss_sums(self, model, batch, rng):
        raise RuntimeError("broken objective")


def test_a_failing_compile_is_raised_and_the_model_keeps_its_parameters(tmp_path):
    model = tiny_model()
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    trainer = BrokenObjective(
        arguments=tiny_arguments(str(tmp_path)), model=model, dataset_train=token_dataset()
    )
    with pytest.raises(RuntimeError, match="broken objective"):
        trainer.train()
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


class RecordsTraceSettings(Trainer):
    """Notes the JAX matmul precision in force while its objective is traced."""

    def compute_loss_sums(self, model, batch, rng):
        self.seen_precision.append(jax.config.jax_default_matmul_precision)
        return super().compute_loss_sums(model, batch, rng)


def test_the_step_is_traced_under_the_caller_s_jax_settings(tmp_path):
    # JAX's settings contexts are per thread: a step traced in the compile thread would
    # silently miss them (here: run at default precision).
    trainer = RecordsTraceSettings(
        arguments=tiny_arguments(str(tmp_path), max_steps=2),
        model=tiny_model(),
        dataset_train=token_dataset(),
    )
    trainer.seen_precision = []
    with jax.default_matmul_precision("highest"):
        trainer.train()
    assert trainer.seen_precision and set(trainer.seen_precision) == {"highest"}


def test_a_model_factory_with_lora_starts_from_the_built_model_s_weights(tmp_path):
    # The factory creates the adapters and the frozen base in one program (its fused random
    # kernels may round the last bit differently from the eager ones).
    built = tiny_trainer(str(tmp_path / "built"), lora_rank=4)
    born = tiny_trainer(str(tmp_path / "born"), model=ModelFactory(tiny_model), lora_rank=4)
    built_state, born_state = built.create_state(), born.create_state()
    assert jax.tree.leaves(born.program.frozen_state())  # the base kernels are frozen, not trained
    for a, b in zip(
        jax.tree.leaves(built_state) + jax.tree.leaves(built.program.frozen_state()),
        jax.tree.leaves(born_state) + jax.tree.leaves(born.program.frozen_state()),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

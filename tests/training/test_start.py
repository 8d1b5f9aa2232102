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


def test_another_learning_rate_schedule_or_decay_compiles_the_same_step(tmp_path):
    """The optimizer's numbers are an input of the step, not constants: a run with another
    learning rate, warmup, length, floor, weight decay and clipping norm compiles the same
    program (the persistent cache reads it back), and that program fed the other run's
    numbers updates exactly as the other run's own step does."""
    common = dict(scheduler="cosine", weight_decay=0.01)
    a = tiny_trainer(str(tmp_path / "a"), **common)
    b = tiny_trainer(
        str(tmp_path / "b"),
        **common | dict(weight_decay=0.2),
        learning_rate=3e-3,
        warmup_steps=4,
        max_steps=30,
        min_lr_ratio=0.1,
        clip_grad=0.5,
    )
    host_batch = next(a.train_source.loader.batches())
    batch = a.sharding_plan.batch.to_global(host_batch, micro_axis=True)
    step_a, step_b = (
        t.program.compile_train_step(t.program.abstract_state(), batch) for t in (a, b)
    )
    programs = [  # StableHLO without source locations: what JAX's persistent cache keys on
        step.lower(t.program.abstract_state(), batch, t.program.frozen_state(), numbers).as_text()
        for step, t in ((step_a, a), (step_b, b))
        for numbers in [t.program.optimizer_numbers()]
    ]
    assert programs[0] == programs[1]

    def five_steps(step, numbers):
        state = b.program.create_state()
        for _ in range(5):  # past B's warmup
            state, metrics = step.compiled(state, batch, b.program.frozen_state(), numbers)
        return state, metrics

    want, want_metrics = five_steps(step_b, b.program.optimizer_numbers())
    got, got_metrics = five_steps(step_a, b.program.optimizer_numbers())
    own, own_metrics = five_steps(step_a, a.program.optimizer_numbers())
    assert float(got_metrics["learning_rate"]) == float(want_metrics["learning_rate"])
    assert float(own_metrics["learning_rate"]) != float(want_metrics["learning_rate"])
    for x, y, z in zip(*(jax.tree.leaves(s.params) for s in (got, want, own))):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)

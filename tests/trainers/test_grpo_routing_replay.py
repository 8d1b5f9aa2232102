"""Rollout routing replay for mixture-of-experts policies, and the routing agreement logged.

- The model: replaying a forward's own experts changes nothing, bit for bit; an unrecorded
  token (-1) routes itself; the router still gets a gradient through the replayed experts.
- Top-1 routing makes the replay exact: a policy whose router differs from the sampler's,
  given the sampler's experts, computes the sampler's log-probs, where without them it does
  not.
- A GRPO run: on the sampler's own parameters every token routes alike (agreement 1); handed
  a sampler whose router was changed, the routing agreement drops, and with routing_replay the
  trainer's log-probs of the round are the sampler's all the same. Its report draws them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matplotlib import image
from trainer_fixtures import tiny_arguments

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.errors import ArgumentError
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM
from jaxtrain.observability.report import write_report
from jaxtrain.rollout_arguments import GRPOArguments
from jaxtrain.trainers import GRPOTrainer
from jaxtrain.trainers.grpo_agreement import routing_agreement
from jaxtrain.training.logps import model_token_logps

# The trainers' test vocabulary (tests/trainers/trainer_fixtures.py).
VOCAB = 64


def tiny_moe(top_k: int = 2, seed: int = 0, layers: int = 2) -> MoeForCausalLM:
    config = MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=top_k,
        moe_intermediate_size=32, pad_token_id=0, eos_token_id=3, initializer_range=0.3,
    )  # fmt: skip
    return MoeForCausalLM(config, rngs=nnx.Rngs(seed))


def with_other_router(model: MoeForCausalLM, seed: int = 7, scale: float = 0.3):
    """A copy of `model` whose routers (every sparse layer's gate) are perturbed, nothing else."""
    other = nnx.clone(model)
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    for layer in other.model.layers:
        gate = layer.mlp.gate.kernel
        gate[...] = gate[...] + scale * jax.random.normal(next(keys), gate[...].shape)
    return other


def ids_and_labels(rows: int = 4, length: int = 12):
    ids = jax.random.randint(jax.random.key(1), (rows, length), 4, VOCAB)
    labels = ids.at[:, :4].set(IGNORE_INDEX)
    return ids, labels


def test_replaying_a_forward_s_own_experts_changes_nothing_and_the_router_still_learns():
    model = tiny_moe()
    ids, labels = ids_and_labels()
    graphdef, params = nnx.split(model)

    @jax.jit
    def hidden(params, routing):  # (hidden states, routing) with `routing` replayed
        return nnx.merge(graphdef, params).hidden_states(ids, routing=routing, return_routing=True)

    h, routing = hidden(params, None)
    assert routing.shape == (4, 2, 12, 2) and routing.dtype == jnp.int32
    replayed, again = hidden(params, routing.astype(jnp.int16))
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(routing))
    nothing, _ = hidden(params, jnp.full_like(routing, -1, dtype=jnp.int16))
    np.testing.assert_array_equal(np.asarray(nothing), np.asarray(h))
    # Other experts replayed: another output, and the routers' gradient is not zero.
    other = jnp.roll(routing, 1, axis=-1).at[..., 0].set((routing[..., 0] + 1) % 4)
    changed, used = hidden(params, other.astype(jnp.int16))
    assert not np.allclose(changed, h) and np.array_equal(used, other)

    def loss(params):
        logps, mask = model_token_logps(nnx.merge(graphdef, params), ids, labels, routing=other)
        return -(logps * mask).sum()

    grads = jax.tree_util.tree_flatten_with_path(jax.jit(jax.grad(loss))(params))[0]
    routers = [g for path, g in grads if "'gate'" in jax.tree_util.keystr(path)]
    assert len(routers) == 2 and all(float(jnp.abs(g).max()) > 0 for g in routers)
    with pytest.raises(ValueError, match=r"routing must be \[batch, 2 sparse layers"):
        model.hidden_states(ids, routing=routing[:, :1])


@functools.partial(jax.jit, static_argnums=0)
def routed_logps(graphdef, params, ids, labels, routing):
    """(the experts the model chooses, its log-probs of `labels` with `routing` replayed)."""
    model = nnx.merge(graphdef, params)
    _, chosen = model.hidden_states(ids, return_routing=True)
    return chosen, model_token_logps(model, ids, labels, routing=routing)[0]


def test_top1_replay_gives_the_sampler_s_log_probs_to_a_policy_with_another_router():
    sampler = tiny_moe(top_k=1)
    trainer = with_other_router(sampler)
    ids, labels = ids_and_labels()
    graphdef = nnx.graphdef(sampler)
    routing, want = routed_logps(graphdef, nnx.state(sampler), ids, labels, None)
    own, unreplayed = routed_logps(graphdef, nnx.state(trainer), ids, labels, None)
    _, replayed = routed_logps(graphdef, nnx.state(trainer), ids, labels, routing)
    logs = routing_agreement(own, routing)
    assert 0.2 < float(logs["sampling/routing_agreement/mean"]) < 1.0
    assert float(logs["sampling/routing_agreement/min"]) <= float(
        logs["sampling/routing_agreement/mean"]
    )
    assert float(jnp.abs(unreplayed - want).max()) > 1e-3
    np.testing.assert_allclose(np.asarray(replayed), np.asarray(want), atol=1e-6)


class StaleRouter:
    """The logs; from step 1 on, the engine samples from the policy with another router."""

    def __init__(self):
        self.logs, self.after_one = [], None

    def on_log(self, trainer, logs, step):
        self.logs.append(dict(logs))

    def on_step_end(self, trainer, state, metrics, step):
        if step == 1:
            self.after_one = jax.tree.map(jnp.copy, state)
            engine = trainer.train_source.engine
            policy = with_other_router(trainer.program.model_from_state(state), scale=0.5)
            engine.update_state(nnx.split(policy)[1])
            engine.update_state = lambda state: None


def test_a_moe_grpo_run_logs_its_routing_agreement_and_replays_the_sampler_s(tokenizer, tmp_path):
    record = StaleRouter()
    args = tiny_arguments(
        GRPOArguments, tmp_path, max_steps=2, total_batch_size=16, num_generations=4,
        max_prompt_length=8, max_completion_length=4, learning_rate=1e-3, temperature=0.8,
        logging_steps=1, routing_replay=True, sampler_correction="token_truncate",
    )  # fmt: skip
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_moe(top_k=1),
        reward_funcs=[lambda prompts, completions, **_: [float(len(c)) for c in completions]],
        dataset_train=[{"prompt": f"what is {i} + {i % 3} ?"} for i in range(8)],
        processing_class=tokenizer,
        callbacks=[record],
    )
    trainer.train()
    first, second = record.logs
    assert first["sampling/routing_agreement/mean"] == 1.0
    assert first["sampling/routing_agreement/min"] == 1.0
    assert second["sampling/routing_agreement/mean"] < 0.95
    # The second round was sampled with another router: replayed through the sampler's
    # experts, the trainer's log-probs are still the sampler's (top-1: only the experts
    # differ); routed by itself, the trainer's are not.
    assert second["sampling/sampling_logp_difference/max"] < 1e-4
    source = trainer.train_source
    rows = source._round.batch
    assert rows["routing"].dtype == jnp.int16 and rows["routing"].shape[2:] == (2, 12, 1)
    policy = trainer.program.model_from_state(record.after_one)
    flat = lambda x: np.asarray(x).reshape(-1, *x.shape[2:])  # noqa: E731
    own, mask = model_token_logps(
        policy, flat(rows["input_ids"]), flat(rows["labels"]), temperature=0.8
    )
    sampler = flat(rows["sampler_logps"])[np.asarray(mask)]
    assert np.abs(np.asarray(own)[np.asarray(mask)] - sampler).max() > 1e-3
    # The run's report draws the RL row: reward, log-prob difference, routing agreement.
    report = write_report(args.output_dir)
    assert image.imread(report.png).shape[:2] == (1250, 1500)
    for key in ("reward", "sampling/sampling_logp_difference/max",
                "sampling/routing_agreement/mean", "sampling/routing_agreement/min"):  # fmt: skip
        assert report.series[key] == ([1, 2], [pytest.approx(e[key]) for e in record.logs])
    summary = dict(report.summary)
    assert float(summary["routing agreement (min)"]) == pytest.approx(
        second["sampling/routing_agreement/min"], rel=1e-3
    )


def test_routing_replay_needs_experts_and_single_turn_rollouts(tokenizer, tmp_path):
    args = tiny_arguments(
        GRPOArguments, tmp_path, total_batch_size=8, num_generations=4, routing_replay=True
    )
    from trainer_fixtures import tiny_model

    with pytest.raises(ArgumentError, match="routing_replay replays a mixture-of-experts"):
        GRPOTrainer(
            arguments=args, model=tiny_model(), reward_funcs=[lambda completions, **_: [0.0]],
            dataset_train=[{"prompt": "what is 1 + 1 ?"}], processing_class=tokenizer,
        )  # fmt: skip


def test_rloo_replays_the_sampler_s_routing_too(tokenizer, tmp_path):
    from jaxtrain.rollout_arguments import RLOOArguments
    from jaxtrain.trainers import RLOOTrainer

    record = StaleRouter()
    args = tiny_arguments(
        RLOOArguments, tmp_path, max_steps=1, total_batch_size=8, num_generations=4,
        max_prompt_length=8, max_completion_length=4, routing_replay=True,
    )  # fmt: skip
    trainer = RLOOTrainer(
        arguments=args,
        model=tiny_moe(),
        reward_funcs=[lambda prompts, completions, **_: [float(len(c)) for c in completions]],
        dataset_train=[{"prompt": f"what is {i} + 1 ?"} for i in range(4)],
        processing_class=tokenizer,
        callbacks=[record],
    )
    trainer.train()
    (logs,) = record.logs
    assert logs["sampling/routing_agreement/mean"] == 1.0 and np.isfinite(logs["loss"])
    assert trainer.train_source._round.batch["routing"].shape[2:] == (2, 12, 2)

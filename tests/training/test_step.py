"""The pure train step: token-weighted gradient accumulation and loss sums."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.state import TrainState
from jaxtrain.training.step import IGNORE_INDEX, causal_lm_sums, make_train_step

CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def padded_batch(rows: int, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows with very different real lengths, right-padded, labels -100 on padding."""
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(1, CONFIG.vocab_size, size=(rows, seq_len)).astype(np.int32)
    lengths = np.linspace(3, seq_len, rows).astype(int)
    rng.shuffle(lengths)
    mask = np.arange(seq_len)[None, :] < lengths[:, None]
    input_ids = np.where(mask, input_ids, 0)
    labels = np.where(mask, input_ids, IGNORE_INDEX).astype(np.int32)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask.astype(np.int32)}


def one_update(batch: dict[str, np.ndarray], accumulation: int):
    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.sgd(0.5)
    step = make_train_step(
        graphdef=graphdef,
        rest=rest,
        optimizer=optimizer,
        schedule=optax.constant_schedule(0.5),
        seed=0,
    )
    shaped = {k: v.reshape(accumulation, -1, v.shape[-1]) for k, v in batch.items()}
    state, metrics = jax.jit(step)(TrainState.create(params, optimizer), shaped)
    return params, state, metrics


def test_accumulation_equals_one_big_batch_with_uneven_padding():
    batch = padded_batch(rows=8, seq_len=24)
    params0, state1, metrics1 = one_update(batch, accumulation=1)
    _, state4, metrics4 = one_update(batch, accumulation=4)
    for a, b, p in zip(
        jax.tree.leaves(state1.params), jax.tree.leaves(state4.params), jax.tree.leaves(params0)
    ):
        assert not np.allclose(a, p)  # the update really moved the weights
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(metrics1["loss_sum"], metrics4["loss_sum"], rtol=1e-5)
    assert float(metrics1["tokens"]) == float(metrics4["tokens"])
    assert int(state4.step) == 1


def test_reported_loss_is_token_weighted_not_mean_of_micro_means():
    batch = padded_batch(rows=8, seq_len=24, seed=3)
    _, _, metrics = one_update(batch, accumulation=4)
    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))
    logits = model(jnp.asarray(batch["input_ids"]))
    sums = causal_lm_sums(logits, jnp.asarray(batch["labels"]))
    token_weighted = float(sums["loss_sum"] / sums["tokens"])
    np.testing.assert_allclose(float(metrics["loss_sum"] / metrics["tokens"]), token_weighted, 1e-5)
    micro_means = []
    for i in range(4):
        rows = slice(2 * i, 2 * i + 2)
        s = causal_lm_sums(logits[rows], jnp.asarray(batch["labels"][rows]))
        micro_means.append(float(s["loss_sum"] / s["tokens"]))
    # The peers' reduction gives a different number on this batch, so the test can tell.
    assert abs(np.mean(micro_means) - token_weighted) > 1e-4


def test_causal_lm_sums_shift_and_ignore():
    logits = jnp.zeros((1, 4, 8)).at[0, 0, 5].set(10.0).at[0, 1, 2].set(10.0)
    labels = jnp.array([[7, 5, 3, IGNORE_INDEX]])
    sums = causal_lm_sums(logits, labels)
    assert float(sums["tokens"]) == 2  # targets 5 and 3; the padded one is ignored
    assert float(sums["correct"]) == 1  # position 0 predicts 5 correctly, position 1 does not
    expected = -jax.nn.log_softmax(logits[0, 0])[5] - jax.nn.log_softmax(logits[0, 1])[3]
    np.testing.assert_allclose(float(sums["loss_sum"]), float(expected), rtol=1e-6)

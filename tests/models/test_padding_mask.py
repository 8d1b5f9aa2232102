"""model(input_ids, attention_mask=...): a left-padded row computes as the unpadded row."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

MODELS = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2), rngs=nnx.Rngs(0)),
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=32, initializer_range=0.2), rngs=nnx.Rngs(0)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_left_padded_rows_match_unpadded_rows(name):
    model = MODELS[name]()
    rng = np.random.RandomState(0)
    short, long = rng.randint(1, 64, size=7), rng.randint(1, 64, size=12)
    pad = 12 - len(short)
    ids = np.stack([np.concatenate([np.zeros(pad, int), short]), long])
    mask = np.stack([np.r_[np.zeros(pad), np.ones(len(short))], np.ones(12)]).astype(np.int32)
    padded = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    alone = np.asarray(model(jnp.asarray(short[None])))[0]
    full = np.asarray(model(jnp.asarray(long[None])))[0]
    assert np.isfinite(padded).all()
    np.testing.assert_allclose(padded[0, pad:], alone, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(padded[1], full, atol=2e-5, rtol=1e-5)
    # Without the mask the padded row really differs (the test would catch a no-op mask).
    unmasked = np.asarray(model(jnp.asarray(ids)))[0, pad:]
    assert np.abs(unmasked - alone).max() > 1e-3


def test_mask_shape_is_checked():
    model = MODELS["llama"]()
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(jnp.ones((2, 8), jnp.int32), attention_mask=jnp.ones((2, 7), jnp.int32))

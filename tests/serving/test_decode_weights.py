"""On the CPU the engine reads each projection kernel from an [out, in] copy
(serving/decode_weights.py): the same numbers as the model's own kernels, every float kernel
copied, the model untouched, and a weight update followed. (That its tokens and log-probs
equal `generate`'s, transformers' and the training code's is tested with the engine.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_models import prompt, tiny_llama
from flax import nnx

from jaxtrain.models.layers import FEW_ROWS, Projection, dense
from jaxtrain.serving import Engine, SamplingParams
from jaxtrain.serving.decode_weights import decode_view, kernel_views, stored_arrays

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)


@pytest.mark.parametrize("rows", [1, FEW_ROWS, FEW_ROWS + 1])
@pytest.mark.parametrize("in_ndim", [1, 2])
def test_a_kernel_stored_transposed_gives_the_same_product(rows, in_ndim):
    rng = np.random.default_rng(rows)
    shape = (3, 4, 5, 6)  # [*in, *out] split after in_ndim dims
    kernel = jnp.asarray(rng.normal(size=shape), jnp.float32)
    x = jnp.asarray(rng.normal(size=(rows, *shape[:in_ndim])), jnp.float32)
    stored = kernel.reshape(int(np.prod(shape[:in_ndim])), -1).T  # what the engine keeps
    view = jax.jit(lambda s: dense(x, s.T.reshape(shape), in_ndim, stored_transposed=True))
    expected = np.tensordot(np.asarray(x), np.asarray(kernel), axes=in_ndim)
    np.testing.assert_allclose(view(stored), expected, rtol=1e-5, atol=1e-5)


def test_every_float_kernel_is_copied_and_the_model_is_untouched():
    model = tiny_llama()
    view, flipped = decode_view(model)
    kernels = {
        tuple(path) + ("kernel",)
        for path, module in nnx.iter_graph(model)
        if isinstance(module, Projection)
    }
    assert {path for path, _ in flipped} == kernels and kernels
    assert not any(
        m.stored_transposed for _, m in nnx.iter_graph(model) if isinstance(m, Projection)
    )
    assert all(m.stored_transposed for _, m in nnx.iter_graph(view) if isinstance(m, Projection))
    state = nnx.state(model)
    _, leaves, views = stored_arrays(state, flipped)
    restored = kernel_views(leaves, views)
    for before, after in zip(jax.tree.leaves(state), restored, strict=True):
        np.testing.assert_array_equal(before, after)  # the same numbers, seen again
    in_ndims = [in_ndim for _, in_ndim in flipped]
    for (index, shape), in_ndim in zip(views, in_ndims, strict=True):  # [out, in] matrices
        assert leaves[index].shape == (np.prod(shape[in_ndim:]), np.prod(shape[:in_ndim]))


def test_an_update_is_copied_again():
    model = tiny_llama()
    engine = Engine(model, max_slots=1, page_size=4, max_length=48, eos_token_ids=[])
    before = engine.generate([prompt(5, 1)], GREEDY)[0][0]
    other = tiny_llama(seed=1)
    engine.update_state(nnx.state(other))
    after = engine.generate([prompt(5, 1)], GREEDY)[0][0]
    fresh = Engine(other, max_slots=1, page_size=4, max_length=48, eos_token_ids=[])
    expected = fresh.generate([prompt(5, 1)], GREEDY)[0][0]
    assert after.token_ids == expected.token_ids and after.logprobs != before.logprobs

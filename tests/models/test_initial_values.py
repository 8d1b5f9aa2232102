"""Eager initial weights (models/initial_values.py) are the bits a traced build draws, from a
program per size class instead of one per shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import LlamaConfig, LlamaForCausalLM, MoeConfig, MoeForCausalLM
from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel
from jaxtrain.models.initial_values import SHARED_DRAW_MAX, _compiled_draw, draw_normal, size_class
from jaxtrain.models.vit import ViTConfig, ViTForImageClassification


def bits(array) -> np.ndarray:
    return np.asarray(array).view(np.uint8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_an_eager_draw_is_the_traced_draw_of_its_own_shape(dtype):
    key = jax.random.key(11)
    # Sizes on both sides of power-of-two boundaries, 1-4 dims, several deviations.
    for shape in [(1,), (3,), (2, 2), (5,), (31, 33), (1024,), (1025,), (2, 3, 4, 5), (96, 40)]:
        for std in (0.02, 1.0, 0.5 / 7):
            eager = draw_normal(key, shape, std, dtype)
            traced = jax.jit(draw_normal, static_argnums=(1, 2, 3))(key, shape, std, dtype)
            assert eager.shape == shape and eager.dtype == jnp.dtype(dtype)
            assert (bits(eager) == bits(traced)).all(), (shape, std)
    # The values are normal with that deviation (not a cut of something else).
    sample = np.asarray(draw_normal(key, (300, 100), 0.02, jnp.float32))
    assert abs(sample.std() - 0.02) < 0.001 and abs(sample.mean()) < 0.001


def test_an_eager_draw_is_an_array_of_its_own_that_a_step_can_donate():
    """Not numpy's memory under the cut: the Trainer's first step takes the model's buffers
    over (tests/training/test_trainer.py), and the draw they were cut from is freed."""
    values = draw_normal(jax.random.key(1), (30, 100), 0.02, jnp.float32)
    pointer = values.unsafe_buffer_pointer()
    doubled = jax.jit(lambda x: x * 2, donate_argnums=0)(values)
    assert doubled.unsafe_buffer_pointer() == pointer and values.is_deleted()


def test_shapes_of_one_size_class_share_one_program():
    _compiled_draw.clear_cache()
    key = jax.random.key(0)
    for shape in [(3, 5, 7), (7, 15), (106,), (110,), (112,)]:  # 105..112 values: class 112
        draw_normal(key, shape, 0.02, jnp.float32)
    assert _compiled_draw._cache_size() == 1
    draw_normal(key, (113,), 0.02, jnp.float32)  # the next size class
    draw_normal(key, (7, 15), 0.02, jnp.bfloat16)  # another dtype
    assert _compiled_draw._cache_size() == 3


def test_size_classes_pad_under_an_eighth_and_large_draws_are_their_own():
    for size in [*range(1, 300), 1000, 65_537, 1_000_001, SHARED_DRAW_MAX]:
        assert size <= size_class(size) < size * 1.125 + 1, size
    assert len({size_class(n) for n in range((1 << 10) + 1, (1 << 11) + 1)}) == 8
    _compiled_draw.clear_cache()
    draw_normal(jax.random.key(0), (SHARED_DRAW_MAX + 1,), 0.02, jnp.float32)
    draw_normal(jax.random.key(0), (SHARED_DRAW_MAX + 3,), 0.02, jnp.float32)
    assert _compiled_draw._cache_size() == 2  # a program each: no padding to draw


def test_without_partitionable_threefry_each_shape_draws_its_own():
    """A longer draw does not start with a shorter one then: no cut, the shape's own draw."""
    key = jax.random.key(5)
    with jax.threefry_partitionable(False):
        longer = np.asarray(jax.random.normal(key, (8,)))
        assert not np.array_equal(longer[:5], np.asarray(jax.random.normal(key, (5,))))
        eager = draw_normal(key, (5,), 1.0, jnp.float32)
        traced = jax.jit(lambda k: draw_normal(k, (5,), 1.0, jnp.float32))(key)
    assert (bits(eager) == bits(traced)).all()


SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
GPT2 = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)  # fmt: skip
VIT = dict(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
           num_attention_heads=4, intermediate_size=48, num_labels=3)  # fmt: skip
MOE = dict(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
BUILDS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL), rngs=nnx.Rngs(0)),
    "moe": lambda: MoeForCausalLM(MoeConfig(**MOE), rngs=nnx.Rngs(0)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(**GPT2), rngs=nnx.Rngs(0)),
    "vit": lambda: ViTForImageClassification(ViTConfig(**VIT), rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("family", sorted(BUILDS))
def test_an_eager_model_build_equals_a_traced_one(family):
    """What a sharded build inside jit creates (parallel/init.py) is what building the model
    eagerly gives, to the bit: MoE experts, GPT-2's positions and ViT's tokens once came from
    flax's initializer, whose eager multiply rounded apart from its traced one."""
    build = BUILDS[family]
    eager = nnx.to_flat_state(nnx.state(build(), nnx.Param))
    traced = nnx.to_flat_state(jax.jit(lambda: nnx.state(build(), nnx.Param))())
    assert [path for path, _ in eager] == [path for path, _ in traced]
    for (path, got), (_, want) in zip(eager, traced):
        assert (bits(got[...]) == bits(want[...])).all(), path

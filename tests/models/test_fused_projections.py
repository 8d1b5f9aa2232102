"""q/k/v and gate/up read slices of their fused kernels; LoRA adapters on those projections
still act (they add to the fused output), so an adapted model equals its merged copy."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.models.lora import apply_lora, lora_projections, merge_lora


@nnx.jit
def forward(model, ids):
    return model(ids)


def test_lora_on_fused_projections_changes_the_output_like_the_merged_kernel():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         attention_bias=True, initializer_range=0.2)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)))
    base = forward(model, ids)
    apply_lora(model, rank=2, alpha=4.0, targets=["qkv_proj", "gate_up_proj"])
    adapted = lora_projections(model)
    assert sorted(str(p[-1]) for p, _ in adapted) == ["gate_up_proj", "qkv_proj"]
    for i, (_, projection) in enumerate(adapted):  # B starts at zero: make it act
        b = projection.lora.b
        b[...] = 0.5 * jax.random.normal(jax.random.key(i), b[...].shape)
    with_adapters = forward(model, ids)
    merged = forward(merge_lora(model), ids)  # adapters folded into the kernels
    assert not np.allclose(with_adapters, base, atol=1e-3)
    np.testing.assert_allclose(with_adapters, merged, rtol=1e-4, atol=1e-5)

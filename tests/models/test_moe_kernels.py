"""The MoE Pallas kernels compile for the platforms they are for, from this CPU: JAX lowers
them for CUDA (our Triton kernels, each module verified as XLA:GPU verifies it) and for TPU
(megablox) without a device, so a kernel that Triton or Mosaic cannot take fails here, not on a
lent GPU. Their numbers are checked in
Pallas' interpret mode by tests/models/test_moe.py, against every expert on every token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.errors import ArgumentError
from jaxtrain.models.moe_kernels import gpu_grouped_matmul, tile, tpu_ragged_matmul

# A ~1B MoE layer's gate/up projection: 8 experts, hidden 2048, 2 x 2816 wide, 128-row blocks.
BLOCKS, ROWS, HIDDEN, WIDTH, EXPERTS = 40, 128, 2048, 5632, 8


def _value_and_grad(matmul):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(matmul(*a).astype(jnp.float32)), (0, 1)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_gpu_kernels_lower_to_triton_forward_and_backward(dtype, verified_triton):
    x = jax.ShapeDtypeStruct((BLOCKS, ROWS, HIDDEN), dtype)
    w = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, WIDTH), dtype)
    block_expert = jax.ShapeDtypeStruct((BLOCKS,), jnp.int32)
    used = jax.ShapeDtypeStruct((), jnp.int32)
    lowered = _value_and_grad(gpu_grouped_matmul).trace(x, w, block_expert, used)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    # The forward, the input gradient (w read transposed) and the weight gradient.
    assert text.count("__gpu$xla.gpu.triton") == 3
    # And verified as XLA:GPU verifies them (a loop bound typed i1 once failed only there).
    assert len(verified_triton) == 3, verified_triton


def test_the_tpu_kernels_lower_to_mosaic_forward_and_backward():
    rows = jax.ShapeDtypeStruct((BLOCKS * ROWS, HIDDEN), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, WIDTH), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)

    def matmul(rows, w, sizes):
        return tpu_ragged_matmul(rows, w, sizes, interpret=False)

    text = (
        _value_and_grad(matmul).trace(rows, w, sizes).lower(lowering_platforms=("tpu",)).as_text()
    )
    assert text.count("tpu_custom_call") == 3  # gmm, its input gradient, tgmm


def test_tiles_are_powers_of_two_triton_can_multiply():
    assert [tile(n, 128) for n in (1, 12, 16, 24, 100, 128, 5632)] == [
        16,
        16,
        16,
        32,
        128,
        128,
        128,
    ]
    assert tile(2048, 64) == 64


def test_asking_for_the_kernels_on_a_cpu_says_what_runs_there():
    from jaxtrain.models.moe_dispatch import expert_mlp

    x, routing = jnp.ones((4, 16)), jnp.zeros((4, 1), jnp.int32)
    gate_up, down = jnp.ones((2, 16, 2, 16)), jnp.ones((2, 16, 16))
    with pytest.raises(ArgumentError, match="GPU or TPU, not on cpu; use 'blocks' there"):
        expert_mlp(x, routing, jnp.ones((4, 1)), gate_up, down, implementation="pallas")


def test_each_platform_defaults_to_its_fastest_measured_dispatch():
    from jaxtrain.models.moe_dispatch import default_implementation
    from jaxtrain.models.sharding import step_platform

    assert default_implementation(*step_platform()) == "blocks"  # this CPU
    # CPU: the blocked loop (ragged_dot is a dense product there). An NVIDIA GPU from Ampere
    # on: our Triton kernels, 2.2x ragged_dot's training tokens/s on an H200 (bench/RESULTS.md,
    # session 56). Older or other GPUs (no bf16 Triton dot), and a TPU until megablox is
    # measured on one: ragged_dot.
    devices = [("cpu", None), ("gpu", 9.0), ("gpu", 8.0), ("gpu", 7.0), ("gpu", None),
               ("tpu", None)]  # fmt: skip
    assert [default_implementation(*d) for d in devices] == [
        "blocks", "pallas", "pallas", "ragged_dot", "ragged_dot", "ragged_dot"
    ]  # fmt: skip

"""The campaign's gmm stage (bench/accelerator.py): one grouped matmul of a MoE layer by each
kernel there is for it. Run by bench/accelerator_stages.py."""

from __future__ import annotations

import time

import numpy as np

# The gmm stage: one grouped matmul of a MoE layer (the 1b twin's gate/up projection at 4 x
# 4096 tokens, top-2) with uneven groups.
GMM_SHAPES = {
    "1b": dict(rows=32768, k=2048, n=5632, experts=8, block=128),
    "tiny": dict(rows=64, k=32, n=48, experts=4, block=16),
}


def grouped_matmul_kernels(size: str) -> dict:
    """Milliseconds of one grouped matmul (bf16) by `jax.lax.ragged_dot`, by our Pallas kernel
    (models/moe_kernels.py; interpreted off a GPU) and, on a Hopper GPU, by JAX's Mosaic-GPU
    example kernel (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu); each one's largest
    difference from ragged_dot's output."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.models.moe_kernels import gpu_grouped_matmul

    shape = GMM_SHAPES[size]
    rows, k, n, e, block = (shape[x] for x in ("rows", "k", "n", "experts", "block"))
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(rows, rng.dirichlet(np.full(e, 2.0))).astype(np.int32)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(e, k, n)) / np.sqrt(k), jnp.bfloat16)
    # The blocked layout our kernel takes: each group padded to whole blocks.
    padded = -(-sizes // block) * block
    pstarts = np.cumsum(padded) - padded
    dest = np.concatenate([pstarts[g] + np.arange(sizes[g]) for g in range(e)])
    num_blocks = int(padded.sum()) // block + 1
    blocks = jnp.zeros((num_blocks * block, k), x.dtype).at[dest].set(x)
    blocks = blocks.reshape(num_blocks, block, k)
    block_expert = jnp.asarray(
        np.repeat(np.arange(e), padded // block).tolist() + [e - 1], jnp.int32
    )
    used = jnp.int32(num_blocks - 1)
    interpret = jax.default_backend() != "gpu"
    groups = jnp.asarray(sizes)
    # name -> (the timed function, its arguments (not constants of the program), its output
    # as rows in ragged_dot's order: not timed).
    kernels = {
        "ragged_dot": (jax.lax.ragged_dot, (x, w, groups), lambda y: y),
        "pallas": (
            lambda *a: gpu_grouped_matmul(*a, interpret),
            (blocks, w, block_expert, used),
            lambda y: y.reshape(-1, n)[dest],
        ),
    }
    kind = str(getattr(jax.devices()[0], "device_kind", ""))
    if "H100" in kind or "H200" in kind:

        def mgpu(x, w, groups):  # imported when traced: inside the loop's try
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

            return ragged_dot_mgpu.ragged_dot(
                x, w, group_sizes=groups, block_m=128, block_n=128, block_k=64,
                max_concurrent_steps=4, grid_block_n=1,
            )  # fmt: skip

        kernels["mgpu"] = (mgpu, (x, w, groups), lambda y: y)
    result: dict = {**shape, "group_sizes": sizes.tolist(), "kernels": {}}
    reference = None
    for name, (call, args, as_rows) in kernels.items():
        try:
            step = jax.jit(call)
            out = jax.block_until_ready(step(*args))
            times = []
            for _ in range(10):
                start = time.perf_counter()
                jax.block_until_ready(step(*args))
                times.append(time.perf_counter() - start)
        except Exception as err:  # a kernel this device or JAX cannot run: recorded
            result["kernels"][name] = {"error": str(err).splitlines()[0][:300]}
            continue
        out = np.asarray(as_rows(out), np.float32)
        reference = out if reference is None else reference
        ms = 1000 * float(np.median(times))
        result["kernels"][name] = {
            "ms": ms,
            "tflops": 2 * rows * k * n / (ms / 1000) / 1e12,
            "max_abs_diff_from_ragged_dot": float(np.abs(out - reference).max()),
        }
    return result

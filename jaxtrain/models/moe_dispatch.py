"""Token dispatch for mixture-of-experts layers: routing, and exact grouped expert matmuls.

Every (token, choice) pair of the top-k routing is a *row*. Rows are sorted by expert, so
each expert's rows are contiguous, then multiplied by that expert's weights only: no token
is dropped (unless a ``capacity_factor`` asks for it) and no expert computes rows that are
not its own. Exact implementations of the grouped matmul:

- ``"blocks"`` (the default on CPU): each expert's rows are padded to a multiple of a block
  of rows, so every block belongs to one expert; a loop runs only over the blocks in use
  (a custom VJP keeps the backward a loop too). XLA:CPU lowers ``jax.lax.ragged_dot`` to a
  dense masked product over *all* experts (8x the work at 8 experts), this costs about a
  dense matmul of the active rows.
- ``"ragged_dot"`` (the default on TPU): ``jax.lax.ragged_dot`` on the sorted rows.
- ``"pallas"`` (GPU/TPU; the default on NVIDIA GPUs from Ampere on): Pallas kernels (``moe_kernels``): ours on the
  blocks on a GPU (2.2x ``ragged_dot``'s training tokens/s on an H200, bench/RESULTS.md),
  JAX's megablox on the sorted rows on a TPU (not yet measured there). ``"interpret"`` and
  ``"interpret_tpu"`` run the GPU's and the TPU's kernel code in Pallas' interpret mode on
  any platform (tests).

``dense_reference`` runs every expert on every token and weights the outputs: the
definition the dispatch is tested against.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.errors import ArgumentError
from jaxtrain.models.blocks import gated
from jaxtrain.models.moe_kernels import gpu_grouped_matmul, tpu_ragged_matmul
from jaxtrain.models.sharding import step_platform

Array = jax.Array

PALLAS_IMPLEMENTATIONS = ("pallas", "interpret", "interpret_tpu")
IMPLEMENTATIONS = ("blocks", "ragged_dot", *PALLAS_IMPLEMENTATIONS)


# Our Triton kernels multiply bf16 blocks: NVIDIA GPUs from Ampere on.
TRITON_MIN_CAPABILITY = 8.0


def default_implementation(platform: str, compute_capability: float | None = None) -> str:
    """What ``moe_implementation=None`` runs on a device of ``platform`` (and, on an NVIDIA
    GPU, ``compute_capability``; models/sharding.step_platform gives both for the devices the
    step is traced for): the blocked loop on CPU, our Triton kernels on an NVIDIA GPU (2.2x
    ``ragged_dot``'s training tokens/s on an H200), ``ragged_dot`` elsewhere (a TPU until
    megablox is measured there, other GPUs)."""
    if platform == "cpu":
        return "blocks"
    if platform == "gpu" and (compute_capability or 0.0) >= TRITON_MIN_CAPABILITY:
        return "pallas"
    return "ragged_dot"


def platform_kernel(implementation: str) -> str:
    """Which layout and kernel an implementation runs here: "blocks", "ragged_dot",
    "gpu" or "gpu_interpret" (blocked layout), "tpu" or "tpu_interpret" (ragged layout)."""
    if implementation == "interpret":
        return "gpu_interpret"
    if implementation == "interpret_tpu":
        return "tpu_interpret"
    if implementation != "pallas":
        return implementation
    platform, _ = step_platform()
    if platform not in ("gpu", "tpu"):
        raise ArgumentError(
            f"moe_implementation='pallas' runs Pallas kernels on a GPU or TPU, not on "
            f"{platform}; use 'blocks' there (or 'interpret' to run the kernel's code slowly)."
        )
    return platform


def route(
    logits: Array, top_k: int, *, normalize: bool, replay: Array | None = None
) -> tuple[Array, Array, Array]:
    """(weights [N, k], experts [N, k], probabilities [N, E]) from router logits [N, E].

    Softmax over all experts in float32, then the top k; ``normalize`` rescales the k
    weights to sum to 1 (Mixtral always, Qwen-MoE when ``norm_topk_prob``). ``replay``
    [N, k]: experts chosen before (by a sampler: routing replay) used instead of the top k,
    weighted by this router's probabilities of them, so the router still learns; a token
    whose row holds a -1 (nothing recorded) takes its own top k.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if replay is not None:
        recorded = jnp.all(replay >= 0, axis=-1, keepdims=True)
        experts = jnp.where(recorded, replay.astype(experts.dtype), experts)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def router_losses(logits: Array, experts: Array, num_experts: int) -> tuple[Array, Array]:
    """(load-balancing loss, z-loss) of one layer's routing over N tokens.

    balance = E * sum_e f_e * P_e, with f_e the tokens routed to expert e (any of their k
    choices) over N and P_e the mean router probability of e: HF's Mixtral/Qwen-MoE form,
    k at perfectly uniform routing. z = mean over tokens of logsumexp(logits)^2 (ST-MoE).
    """
    logits = logits.astype(jnp.float32)
    n = logits.shape[0]
    probs = jax.nn.softmax(logits, axis=-1)
    counts = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
    balance = num_experts * jnp.sum((counts / n) * jnp.mean(probs, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return balance, z


# ------------------------------------------------------------------ blocked grouped matmul
def _block_products(x: Array, w: Array, block_expert: Array, used: Array) -> Array:
    """y[j] = x[j] @ w[block_expert[j]] for blocks j < used, zeros after. x [NB, B, K]."""

    # dynamic_index / dynamic_update (not .at[] scatters): XLA updates the carry in place.
    def body(j, y):
        w_j = jax.lax.dynamic_index_in_dim(w, block_expert[j], keepdims=False)
        x_j = jax.lax.dynamic_index_in_dim(x, j, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(y, x_j @ w_j, j, axis=0)

    zeros = jnp.zeros((*x.shape[:2], w.shape[-1]), x.dtype)
    return jax.lax.fori_loop(0, used, body, zeros)


@jax.custom_vjp
def grouped_matmul(x: Array, w: Array, block_expert: Array, used: Array) -> Array:
    """Blocks of rows times their expert's matrix: x [NB, B, K], w [E, K, M] -> [NB, B, M].

    Only the first ``used`` blocks are computed (a loop with a traced trip count), forward
    and backward; the gradient of ``w`` accumulates in place, one block at a time.
    """
    return _block_products(x, w, block_expert, used)


def _grouped_fwd(x, w, block_expert, used):
    return _block_products(x, w, block_expert, used), (x, w, block_expert, used)


def _grouped_bwd(res, dy):
    x, w, block_expert, used = res
    dx = _block_products(dy, jnp.swapaxes(w, 1, 2), block_expert, used)

    def body(j, dw):
        e = block_expert[j]
        x_j = jax.lax.dynamic_index_in_dim(x, j, keepdims=False)
        dy_j = jax.lax.dynamic_index_in_dim(dy, j, keepdims=False)
        dw_e = jax.lax.dynamic_index_in_dim(dw, e, keepdims=False) + x_j.T @ dy_j
        return jax.lax.dynamic_update_index_in_dim(dw, dw_e, e, axis=0)

    dw = jax.lax.fori_loop(0, used, body, jnp.zeros_like(w))
    return dx, dw, None, None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


def _block_size(rows: int, experts: int) -> int:
    """Rows per block: about one expert's share, a power of two in [8, 128]."""
    share = max(rows // max(experts, 1), 1)
    return int(min(128, max(8, 2 ** math.ceil(math.log2(share)))))


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows one expert may take: ceil(capacity_factor * tokens * k / E)."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def expert_mlp(
    x: Array,
    experts: Array,
    weights: Array,
    gate_up: Array,
    down: Array,
    *,
    first_expert: Array | int = 0,
    num_experts: int | None = None,
    capacity_factor: float | None = None,
    implementation: str | None = None,
    activation: Any = jax.nn.silu,
) -> Array:
    """sum_k weights[n, k] * expert_{experts[n, k]}(x[n]) for the experts held here.

    x [N, D]; experts, weights [N, k]; gate_up [L, D, 2, F] and down [L, F, D] are the
    weights of experts first_expert .. first_expert + L - 1 of ``num_experts`` (all of them
    unless expert-parallel). Rows routed elsewhere contribute nothing here (an ep psum adds
    the other devices' share). With ``capacity_factor`` an expert keeps at most
    ``capacity(N, k, E, capacity_factor)`` rows, the earliest tokens first, and the rest are
    dropped (their contribution is zero); None is dropless.
    """
    n, d = x.shape
    k = experts.shape[1]
    local, _, _, f = gate_up.shape
    total = local if num_experts is None else num_experts
    implementation = implementation or default_implementation(*step_platform())
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"moe implementation={implementation!r} is not one of {IMPLEMENTATIONS}.")
    kernel = platform_kernel(implementation)
    rows = n * k
    # Local experts first (0..L-1), in expert order, then the rows of other devices' experts.
    key = (experts.reshape(-1) - first_expert) % total
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    token = order // k
    counts = jnp.zeros((total,), jnp.int32).at[key].add(1)[:local]
    starts = jnp.cumsum(counts) - counts
    kept = counts
    cap = None
    if capacity_factor is not None:
        cap = capacity(n, k, total, capacity_factor)
        kept = jnp.minimum(counts, cap)
    is_local = sorted_key < local
    e = jnp.minimum(sorted_key, local - 1)
    rank = jnp.arange(rows, dtype=jnp.int32) - starts[e]
    keep = is_local & (rank < kept[e])
    gu = gate_up.reshape(local, d, 2 * f).astype(x.dtype)
    dn = down.astype(x.dtype)
    xs = x[token]  # [R, D]

    if kernel in ("ragged_dot", "tpu", "tpu_interpret"):
        # Rows of other experts (and capacity drops) are zeroed, then all kept rows of
        # expert e sit first in its group: group sizes are the kept counts, the rest
        # of each group becomes the tail no group covers.
        pos = jnp.where(keep, (jnp.cumsum(kept) - kept)[e] + rank, rows)
        packed = jnp.zeros((rows, d), x.dtype).at[pos].set(xs, mode="drop")
        if kernel == "ragged_dot":
            ragged = jax.lax.ragged_dot
        else:
            interpret = kernel == "tpu_interpret"
            ragged = functools.partial(tpu_ragged_matmul, interpret=interpret)
        h = ragged(packed, gu, kept)
        h = gated(activation, h[:, :f], h[:, f:])
        y_packed = ragged(h, dn, kept)
        ys = jnp.take(y_packed, pos, axis=0, mode="fill", fill_value=0)
    else:
        block = _block_size(rows, total)
        if kernel == "blocks":
            matmul = grouped_matmul
        else:  # Triton's dot takes blocks of at least 16 rows
            block = max(block, 16)
            matmul = functools.partial(gpu_grouped_matmul, interpret=kernel == "gpu_interpret")
        padded = -(-kept // block) * block
        if cap is not None:
            num_blocks = local * -(-cap // block)
        else:  # worst case: every row is local and each expert wastes < one block
            num_blocks = -(-(rows + local * (block - 1)) // block)
        pstart = jnp.cumsum(padded) - padded
        dest = jnp.where(keep, pstart[e] + rank, num_blocks * block)
        blocks = jnp.zeros((num_blocks * block, d), x.dtype).at[dest].set(xs, mode="drop")
        ends = jnp.cumsum(padded)
        block_expert = jnp.searchsorted(ends, jnp.arange(num_blocks) * block, side="right")
        block_expert = jnp.minimum(block_expert, local - 1).astype(jnp.int32)
        used = (ends[-1] // block).astype(jnp.int32)
        h = matmul(blocks.reshape(num_blocks, block, d), gu, block_expert, used)
        h = gated(activation, h[..., :f], h[..., f:])
        y_blocks = matmul(h, dn, block_expert, used).reshape(num_blocks * block, d)
        ys = jnp.take(y_blocks, dest, axis=0, mode="fill", fill_value=0)

    w = weights.reshape(-1)[order].astype(x.dtype)
    ys = jnp.where(keep[:, None], ys, 0) * w[:, None]
    return jnp.zeros((n, d), x.dtype).at[token].add(ys)


def dense_reference(
    x: Array,
    experts: Array,
    weights: Array,
    gate_up: Array,
    down: Array,
    activation: Any = jax.nn.silu,
) -> Array:
    """Every expert on every token, combined with the routing weights (zero if unchosen)."""
    num_experts = gate_up.shape[0]
    h = jnp.einsum("nd,edcf->necf", x, gate_up)
    out = jnp.einsum("nef,efd->ned", activation(h[:, :, 0]) * h[:, :, 1], down)
    combine = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=x.dtype) * weights[..., None], 1)
    return jnp.einsum("ne,ned->nd", combine, out)

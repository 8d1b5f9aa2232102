"""Ring attention over the ``sp`` mesh axis.

With the sequence split over sp = n devices, each device keeps its own chunk of queries and
passes its key/value chunk (with the chunk's segment ids) to the next device n - 1 times;
every arrival is folded into the running output with the online-softmax combination of
(output, log-sum-exp) pairs. A chunk's global token index follows from the ring step, so
causal order and sliding windows hold across devices, and a chunk wholly in a query chunk's
future (or outside its window, or in other documents) computes nothing: blockwise.py's
``chunk_forward`` skips every block of it.

The backward pass (``jax.custom_vjp``) sends the key/value chunks round again, this time
with their gradient accumulators, which arrive back at their owner after n steps; only the
local q, k, v, output and log-sum-exp are saved.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxtrain.models.blockwise import (
    AttentionSpec,
    blocked_inputs,
    chunk_backward,
    chunk_forward,
    default_blocks,
    make_spec,
    output_delta,
    to_block_layout,
    unblocked,
    unblocked_grads,
)
from jaxtrain.models.sharding import current_rules

Array = jax.Array

SEQUENCE_AXIS = "sp"  # the mesh axis that splits the length (parallel/rules.py: "length")


def sequence_parallel_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    segment_ids: Array | None,
    sliding_window: int | None,
    scale: float | None,
    logit_cap: float | None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Array | None:
    """Ring attention when the enclosing ``activation_sharding`` rules split the length over
    sp > 1 devices; None otherwise (the caller then runs single-device blockwise attention).
    Shapes as ``blockwise.blockwise_attention``'s, global (jit-level) arrays."""
    rules = current_rules()
    if rules is None:
        return None
    mesh = rules.mesh
    n = dict(mesh.shape).get(SEQUENCE_AXIS, 1)
    if n == 1:
        return None
    t = q.shape[1]
    if t % n:
        raise ValueError(
            f"ring attention: sequence length {t} must be divisible by sp={n}; pad rows to a "
            f"multiple of {n} (max_sequence_length)."
        )
    if segment_ids is None:  # one document (0 would be padding, which is skipped)
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    q_spec = rules.activation_spec(q.shape, ("batch", "length", "heads", None))
    kv_spec = rules.activation_spec(k.shape, ("batch", "length", "kv_heads", None))
    if q_spec[2] != kv_spec[2]:  # shard heads only when q and kv heads split alike (GQA)
        q_spec = P(q_spec[0], q_spec[1], None, None)
        kv_spec = P(kv_spec[0], kv_spec[1], None, None)
    seg_spec = P(q_spec[0], q_spec[1])
    default_q, default_k = default_blocks(ring=True)
    spec = make_spec(
        q,
        kv_length=t // n,
        sliding_window=sliding_window,
        scale=scale,
        logit_cap=logit_cap,
        block_q=block_q or default_q,
        block_k=block_k or default_k,
    )
    spec = dataclasses.replace(spec, block_q=min(spec.block_q, t // n))
    body = functools.partial(ring_attention, spec=spec, axis_name=SEQUENCE_AXIS, axis_size=n)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
        out_specs=q_spec,
        check_vma=False,
    )(q, k, v, segment_ids)


def ring_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    *,
    spec: AttentionSpec,
    axis_name: str,
    axis_size: int,
) -> Array:
    """Per-device body (inside shard_map): q [B, t, N, H], k/v [B, t, K, H], segment_ids
    [B, t] are this device's chunk of the sequence, in ring order along ``axis_name``."""
    return _ring(q, k, v, segment_ids, spec, axis_name, axis_size)


def _send_next(x: Array, axis_name: str, n: int) -> Array:
    """Device d's x goes to device d + 1: at ring step s, device d holds chunk d - s."""
    return lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, segment_ids, spec, axis_name, axis_size):
    return _ring_fwd(q, k, v, segment_ids, spec, axis_name, axis_size)[0]


def _ring_fwd(q, k, v, segment_ids, spec, axis_name, n):
    t = q.shape[1]
    me = lax.axis_index(axis_name)
    qb, kb, vb, qs, ks = blocked_inputs(q, k, v, segment_ids, segment_ids, spec)
    q_start = me * t

    def fold(step, o, lse, kb, vb, ks):
        source = (me - step) % n
        o_s, lse_s = chunk_forward(qb, kb, vb, qs, ks, q_start, source * t, t, spec)
        lse_new = jnp.logaddexp(lse, lse_s)
        o = o * jnp.exp(lse - lse_new)[..., None] + o_s * jnp.exp(lse_s - lse_new)[..., None]
        return o, lse_new

    o, lse = chunk_forward(qb, kb, vb, qs, ks, q_start, q_start, t, spec)

    def step(s, carry):
        o, lse, kb, vb, ks = carry
        kb, vb, ks = (_send_next(x, axis_name, n) for x in (kb, vb, ks))
        o, lse = fold(s, o, lse, kb, vb, ks)
        return o, lse, kb, vb, ks

    o, lse, *_ = lax.fori_loop(1, n, step, (o, lse, kb, vb, ks))
    out = unblocked(o, t).astype(q.dtype)
    return out, (q, k, v, segment_ids, out, lse)


def _ring_bwd(spec, axis_name, n, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    t = q.shape[1]
    me = lax.axis_index(axis_name)
    qb, kb, vb, qs, ks = blocked_inputs(q, k, v, segment_ids, segment_ids, spec)
    kh = k.shape[2]
    do_b = to_block_layout(d_out, kh, spec.block_q)
    delta = output_delta(to_block_layout(out, kh, spec.block_q), do_b)
    q_start = me * t

    def grads(step, kb, vb, ks):
        source = (me - step) % n
        return chunk_backward(qb, kb, vb, qs, ks, q_start, source * t, t, lse, delta, do_b, spec)

    dq, dk, dv = grads(0, kb, vb, ks)

    def step(s, carry):
        dq, kb, vb, ks, dk, dv = carry
        kb, vb, ks, dk, dv = (_send_next(x, axis_name, n) for x in (kb, vb, ks, dk, dv))
        dq_s, dk_s, dv_s = grads(s, kb, vb, ks)
        return dq + dq_s, kb, vb, ks, dk + dk_s, dv + dv_s

    dq, _, _, _, dk, dv = lax.fori_loop(1, n, step, (dq, kb, vb, ks, dk, dv))
    # One more hop brings each gradient accumulator home to the chunk's owner.
    dk, dv = _send_next(dk, axis_name, n), _send_next(dv, axis_name, n)
    return (*unblocked_grads(dq, dk, dv, q, k, v), None)


_ring.defvjp(_ring_fwd, _ring_bwd)

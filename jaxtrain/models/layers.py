"""Shared transformer pieces: projections, RMSNorm, rotary embeddings, the attention block,
SwiGLU. The attention maths itself is in attention.py.

Conventions
- Activations are [B, T, ...]; attention heads use the [B, T, N, H] layout that
  ``jax.nn.dot_product_attention`` expects.
- Parameters are stored in ``param_dtype`` and cast to the compute ``dtype`` where they are
  used, so bf16 compute keeps fp32 master weights.
- Every nnx.Param carries ``logical_axes`` (one name per dim) for the sharding rules.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.attention import causal_attention
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.elementwise import rms_norm, rotary, swiglu
from jaxtrain.models.fp8 import fp8_matmul
from jaxtrain.models.initial_values import normal_param_values
from jaxtrain.models.sharding import constrain, current_rules

Array = jax.Array
DType = Any


# Rows up to which a matrix stored [out, in] multiplies into [out, rows] on the CPU (`dense`).
FEW_ROWS = 64


def dense(
    x: Array, kernel: Array, in_ndim: int = 1, fp8: bool = False, stored_transposed: bool = False
) -> Array:
    """x [*lead, *in] times kernel [*in, *out] -> [*lead, *out], as one 2-D matmul (`fp8`:
    with both operands in float8, models/fp8.py; `stored_transposed`: the kernel is a view of
    an [out, in] matrix, as the tied output head's table and the engine's decode weights are).

    The lead (token) dims are flattened first. Why: the weight gradient of a [B, T, D] x
    [D, F] einsum contracts B and T together, and XLA:CPU lowers that with an
    activation-sized transpose into [F, B * T], fused with the elementwise work before it
    (the SwiGLU backward then runs at a strided, unvectorised pace). As a [B * T, D] matmul
    the gradient is a plain one: an S1 MLP forward and backward ran 1.8x faster
    (bench/RESULTS.md, 2026-11-24, session 7). Under a mesh that shards the length axis
    (sp) merging batch and length would move data between devices, so there the einsum stays
    (in the compute dtype, fp8 or not).
    """
    lead = x.shape[: x.ndim - in_ndim]
    out = kernel.shape[in_ndim:]
    if len(lead) > 1 and _length_is_sharded(lead[1]):  # lead is [batch, length, ...]
        return jnp.tensordot(x, kernel, axes=in_ndim)  # the einsum, dims kept apart
    rows = x.reshape(int(np.prod(lead)), -1)
    matrix = kernel.reshape(rows.shape[1], -1)
    if fp8:
        y = fp8_matmul(rows, matrix)
    elif stored_transposed and rows.shape[0] <= FEW_ROWS and jax.default_backend() == "cpu":
        # A few rows (a decode step) times an [out, in] matrix: XLA:CPU streams the weights
        # ~25% faster into an [out, rows] product than into [rows, out] (SmolLM2-135M, 8 rows:
        # 40 -> 29 ms a step's matmuls; from 256 rows on it is slower). The barrier keeps the
        # small transpose after it out of the matmul's layout, which would undo the gain.
        y = jax.lax.optimization_barrier(jnp.einsum("io,bi->ob", matrix, rows)).T
    else:
        y = rows @ matrix
    return y.reshape(*lead, *out)


def output_head(weights: Array, dtype: DType, *, tied: bool) -> Any:
    """The output head as a pure function ``h [..., D] -> logits [..., vocab]`` over its
    weights (`tied`: the embedding table [vocab, D], else the kernel [D, vocab]).

    On the CPU, in a 16-bit compute dtype, the matmuls run 16-bit x 16-bit into float32 and
    round once, forward and backward (`_head_matmul`). Why: XLA:CPU has no 16-bit-output
    matmul, and for one it converts both operands to float32 first; the head's float32 copy is
    the largest temporary of a small model's step (hidden 1024, vocab 32000: 125 MiB of a
    QLoRA step's ~1 GiB), and autodiff's backward matmul (a float32 cotangent times the 16-bit
    weights) made the same copy. The values are those of float32 accumulation rounded to the
    dtype. GPUs and TPUs multiply into 16 bits natively: there the matmul stays as written
    (a float32 output would be twice the logits' memory)."""
    table = weights.astype(dtype)
    matrix = table.T if tied else table  # folded into the matmul's dimension numbers
    if jnp.dtype(dtype).itemsize != 2 or jax.default_backend() != "cpu":
        return lambda h: dense(h.astype(dtype), matrix, stored_transposed=tied)

    def project(h: Array) -> Array:  # flattened as `dense` does, for the same reason
        h, lead = h.astype(dtype), h.shape[:-1]
        if len(lead) > 1 and _length_is_sharded(lead[1]):
            return _head_matmul(h, matrix)
        return _head_matmul(h.reshape(-1, h.shape[-1]), matrix).reshape(*lead, -1)

    return project


@jax.custom_vjp
def _head_matmul(h: Array, matrix: Array) -> Array:
    """h [..., D] x matrix [D, V] -> [..., V] in h's dtype, accumulated in float32."""
    return jnp.einsum("...d,dv->...v", h, matrix, preferred_element_type=jnp.float32).astype(
        h.dtype
    )


def _head_matmul_forward(h: Array, matrix: Array) -> tuple[Array, tuple[Array, Array]]:
    return _head_matmul(h, matrix), (h, matrix)


def _head_matmul_backward(saved: tuple[Array, Array], grad: Array) -> tuple[Array, Array]:
    h, matrix = saved
    grad = grad.astype(h.dtype)
    f32 = jnp.float32
    grad_h = jnp.einsum("...v,dv->...d", grad, matrix, preferred_element_type=f32)
    grad_matrix = jnp.einsum("...d,...v->dv", h, grad, preferred_element_type=f32)
    return grad_h.astype(h.dtype), grad_matrix.astype(matrix.dtype)


_head_matmul.defvjp(_head_matmul_forward, _head_matmul_backward)


def _length_is_sharded(length: int) -> bool:
    rules = current_rules()
    return rules is not None and rules.activation_spec((length,), ("length",))[0] is not None


@functools.cache
def dense_in_ndim(equation: str) -> int | None:
    """How many dims a token-wise einsum contracts ("btd,dkh->btkh": 1), or None when the
    equation is not of the form lead+in, in+out -> lead+out."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contracted = [c for c in lhs if c in rhs]
    lead = lhs[: len(lhs) - len(contracted)]
    in_s = "".join(contracted)
    if lhs != lead + in_s or not rhs.startswith(in_s) or out != lead + rhs[len(in_s) :]:
        return None
    return len(in_s)


class Projection(nnx.Module):
    """A linear map written as one einsum over a (possibly multi-dim) kernel.

    Multi-dim kernels (e.g. the fused q/k/v kernel (embed, kv_heads, qkv, head_dim)) let
    one matmul produce several outputs while every dim keeps its own logical axis.
    """

    def __init__(
        self,
        kernel_shape: tuple[int, ...],
        kernel_axes: tuple[str | None, ...],
        equation: str,
        *,
        bias_ndim: int | None = None,
        std: float,
        dtype: DType,
        param_dtype: DType,
        rngs: nnx.Rngs,
    ):
        """``bias_ndim``: None for no bias, else the bias covers the last ``bias_ndim`` dims.
        ``fp8`` (set by a run's fp8_matmuls): the matmul with both operands in float8.
        ``stored_transposed`` (set on an engine's view, serving/decode_weights.py): the
        kernel arrives as a view of its [out, in] matrix."""
        self.equation = equation
        self.dtype = dtype
        self.fp8 = False
        self.stored_transposed = False
        self.kernel = nnx.Param(
            normal_param_values(rngs, kernel_shape, std, param_dtype),
            logical_axes=tuple(kernel_axes),
        )
        if bias_ndim is None:
            self.bias = None
        else:
            self.bias = nnx.Param(
                jnp.zeros(kernel_shape[-bias_ndim:], param_dtype),
                logical_axes=tuple(kernel_axes[-bias_ndim:]),
            )

    def __call__(self, x: Array) -> Array:
        x, kernel = x.astype(self.dtype), self.kernel[...].astype(self.dtype)
        in_ndim = dense_in_ndim(self.equation)
        if in_ndim is None:
            y = jnp.einsum(self.equation, x, kernel)
        else:
            y = dense(x, kernel, in_ndim, self.fp8, self.stored_transposed)
        lora = getattr(self, "lora", None)  # a LoRA adapter (jaxtrain.models.lora)
        if lora is not None:
            y = y + lora(x)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embedding(nnx.Module):
    """Token embedding table (vocab, embed); ``attend`` gives tied output logits."""

    def __init__(
        self,
        vocab: int,
        embed: int,
        *,
        std: float,
        dtype: DType,
        param_dtype: DType,
        rngs: nnx.Rngs,
    ):
        self.dtype = dtype
        self.embedding = nnx.Param(
            normal_param_values(rngs, (vocab, embed), std, param_dtype),
            logical_axes=("vocab", "embed"),
        )

    def __call__(self, ids: Array) -> Array:
        # Gather first, cast after: casting the whole table each step would copy it. Under a
        # mesh the table is gathered whole over fsdp (as fsdp does for every use) so the
        # lookup's output can take the batch sharding without an involuntary reshard.
        table = constrain(self.embedding[...], ("vocab", None))
        return constrain(jnp.take(table, ids, axis=0).astype(self.dtype), ("batch", "length", None))

    def attend(self, x: Array) -> Array:
        # The transposed table is folded into the matmul's dimension numbers, not copied.
        return dense(x, self.embedding[...].astype(self.dtype).T, stored_transposed=True)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 (stable for bf16 inputs), output in the compute dtype."""

    def __init__(
        self, dim: int, *, eps: float, dtype: DType, param_dtype: DType, axis: str = "embed"
    ):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis,))

    def __call__(self, x: Array) -> Array:
        return rms_norm(x, self.weight[...], self.eps, self.dtype)


# ------------------------------------------------------------------------------- RoPE
def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None = None
) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32) incl. "linear" and "llama3" scaling.

    Computed with numpy at trace time: they are constants of the config, not parameters.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (float(rope_theta) ** exponents)
    rope_type = "default"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
        # and the band in between is interpolated smoothly.
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope_type != "default":
        raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported.")
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: Array, inv_freq: np.ndarray, dtype: DType) -> tuple[Array, Array]:
    """cos and sin [B, T, head_dim] for explicit integer positions [B, T].

    Angles are formed in float32 (bf16 positions would lose precision past 256), then
    cast. The half-split layout matches HF's rotate_half convention. numpy positions
    (known when tracing, e.g. the default 0..T-1) give constant tables: XLA would otherwise
    recompute cos and sin inside every fusion that reads them. Traced positions (packed
    documents) take cos and sin of the head_dim // 2 distinct angles and repeat the results,
    not the angles: that made a packed S1 train step 1.05x the unpacked one, now 1.01x
    (bench/RESULTS.md, 2026-11-25).
    """
    if isinstance(positions, np.ndarray):
        angles = positions.astype(np.float32)[..., None] * inv_freq
        angles = np.concatenate([angles, angles], axis=-1)
        return jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return (
        jnp.concatenate([cos, cos], axis=-1).astype(dtype),
        jnp.concatenate([sin, sin], axis=-1).astype(dtype),
    )


class Attention(nnx.Module):
    """GQA self-attention with one fused q/k/v kernel (embed, kv_heads, q_per_kv + 2, head_dim).

    Slot g < q_per_kv of kv head k is query head k * q_per_kv + g (HF's GQA grouping), slot
    q_per_kv is the key and q_per_kv + 1 the value. Sharding kv_heads therefore splits q, k
    and v consistently for tensor parallelism.
    """

    def __init__(self, config: LlamaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.q_per_kv = c.num_queries_per_kv
        self.head_dim = c.head_dim
        self.sliding_window = c.sliding_window
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv_proj = Projection(
            (c.hidden_size, c.num_key_value_heads, self.q_per_kv + 2, c.head_dim),
            ("embed", "kv_heads", "qkv", "head_dim"),
            "btd,dkgh->btkgh",
            bias_ndim=3 if c.attention_bias else None,
            **kw,
        )
        self.o_proj = Projection(
            (c.num_attention_heads, c.head_dim, c.hidden_size),
            ("heads", "head_dim", "embed"),
            "btnh,nhd->btd",
            **kw,
        )
        if c.qk_norm:  # Qwen3: RMSNorm of each query / key head over head_dim
            norm_kw = dict(eps=c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.q_norm = RMSNorm(c.head_dim, axis="head_dim", **norm_kw)
            self.k_norm = RMSNorm(c.head_dim, axis="head_dim", **norm_kw)
        else:
            self.q_norm = self.k_norm = None
        self.elementwise_kernels = "xla"  # set by a run's elementwise_kernels (elementwise.py)

    def project(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """q [B, T, N, H] and k, v [B, T, K, H], q and k rotated (also used by the KV cache)."""
        b, t = x.shape[:2]
        g = self.q_per_kv
        proj = self.qkv_proj
        # Slice the fused KERNEL, not its [B, T, K, G + 2, H] output: three matmuls whose
        # outputs are used whole, so the backward pass adds weight-sized slices instead of
        # padding and concatenating activation-sized gradients. A LoRA adapter adds to the
        # fused output, and a decoding step (one token per row, no backward pass) is cheaper
        # as one matmul than three; so is an engine's kernel stored [out, in], whose slices
        # would be copies.
        if getattr(proj, "lora", None) is not None or t == 1 or proj.stored_transposed:
            qkv = proj(x)  # [B, T, K, G + 2, H]
            q, k, v = qkv[..., :g, :], qkv[..., g, :], qkv[..., g + 1, :]
        else:
            kernel = proj.kernel[...].astype(proj.dtype)  # [D, K, G + 2, H]
            x = x.astype(proj.dtype)
            # Query heads as one [D, N, H] kernel: the output is [B, T, N, H] at once, where
            # a [B, T, K, G, H] output costs an activation-sized copy to reshape.
            q_kernel = kernel[:, :, :g].reshape(kernel.shape[0], self.num_heads, self.head_dim)
            q = dense(x, q_kernel)
            k = dense(x, kernel[:, :, g])
            v = dense(x, kernel[:, :, g + 1])
            if proj.bias is not None:
                bias = proj.bias[...].astype(proj.dtype)  # [K, G + 2, H]
                q = q + bias[:, :g].reshape(self.num_heads, self.head_dim)
                k, v = k + bias[:, g], v + bias[:, g + 1]
        q = q.reshape(b, t, self.num_heads, self.head_dim)  # no-op unless LoRA's [B,T,K,G,H]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kernel = self.elementwise_kernels
        return rotary(q, cos, sin, kernel=kernel), rotary(k, cos, sin, kernel=kernel), v

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        segment_ids: Array | None = None,
        implementation: str | None = None,
    ) -> Array:
        q, k, v = self.project(x, cos, sin)
        out = causal_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            sliding_window=self.sliding_window,
            implementation=implementation,
        )
        return self.o_proj(out)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate and up fused in one (embed, 2, mlp) kernel."""

    def __init__(self, config: LlamaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        c = config
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_up_proj = Projection(
            (c.hidden_size, 2, c.intermediate_size),
            ("embed", "gate_up", "mlp"),
            "btd,dcf->btcf",
            bias_ndim=2 if c.mlp_bias else None,
            **kw,
        )
        self.down_proj = Projection(
            (c.intermediate_size, c.hidden_size),
            ("mlp", "embed"),
            "btf,fd->btd",
            bias_ndim=1 if c.mlp_bias else None,
            **kw,
        )
        self.elementwise_kernels = "xla"  # set by a run's elementwise_kernels (elementwise.py)

    def __call__(self, x: Array) -> Array:
        # Like q/k/v: slice the fused (embed, 2, mlp) kernel, not the [B, T, 2, F] output.
        proj = self.gate_up_proj
        if getattr(proj, "lora", None) is not None or x.shape[1] == 1 or proj.stored_transposed:
            gate_up = proj(x)  # [B, T, 2, F]
            gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
        else:
            kernel = proj.kernel[...].astype(proj.dtype)
            x = x.astype(proj.dtype)
            gate = dense(x, kernel[:, 0])
            up = dense(x, kernel[:, 1])
            if proj.bias is not None:
                bias = proj.bias[...].astype(proj.dtype)  # [2, F]
                gate, up = gate + bias[0], up + bias[1]
        return self.down_proj(swiglu(gate, up, kernel=self.elementwise_kernels))

"""A straightforward hand-written Llama in pure JAX: the speed baseline for overhead.py.

Written the way a person would write it from the paper, with no library beyond jax/numpy:
params are a plain dict (a list of per-layer dicts), q/k/v and gate/up are separate matmuls,
attention is spelled out (scores, causal mask, softmax in fp32, weighted sum). Same maths as
jaxtrain's LlamaForCausalLM (RMSNorm, rotary in the rotate-half layout, SwiGLU, untied
head), so `overhead.py --check` can load jaxtrain's weights into it and compare losses.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Hyper-parameters of the benchmarked models (multi-head attention, no GQA)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    seq: int
    batch: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def init_params(key: jax.Array, shape: LlamaShape) -> dict:
    """Normal(0, init_std) matrices, unit norm scales, fp32."""
    d, f, v = shape.hidden, shape.intermediate, shape.vocab
    keys = iter(jax.random.split(key, 2 + 7 * shape.layers))

    def normal(*dims: int) -> jax.Array:
        return shape.init_std * jax.random.normal(next(keys), dims, jnp.float32)

    layers = []
    for _ in range(shape.layers):
        layers.append(
            {
                "attn_norm": jnp.ones((d,), jnp.float32),
                "wq": normal(d, d),
                "wk": normal(d, d),
                "wv": normal(d, d),
                "wo": normal(d, d),
                "mlp_norm": jnp.ones((d,), jnp.float32),
                "w_gate": normal(d, f),
                "w_up": normal(d, f),
                "w_down": normal(f, d),
            }
        )
    return {
        "embed": normal(v, d),
        "layers": layers,
        "final_norm": jnp.ones((d,), jnp.float32),
        "lm_head": normal(d, v),
    }


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return weight * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def rotary_tables(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, head_dim // 2] for positions 0..T-1 (constants, built with numpy)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(seq, dtype=np.float64)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of x [B, T, N, H]; pairs are (i, i + H/2) as in HF's rotate_half."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(x: jax.Array, layer: dict, shape: LlamaShape, cos, sin) -> jax.Array:
    b, t, _ = x.shape
    n, h = shape.heads, shape.head_dim
    q = rotate((x @ layer["wq"]).reshape(b, t, n, h), cos, sin)
    k = rotate((x @ layer["wk"]).reshape(b, t, n, h), cos, sin)
    v = (x @ layer["wv"]).reshape(b, t, n, h)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(h)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bnqk,bknh->bqnh", weights, v).reshape(b, t, n * h)
    return out @ layer["wo"]


def swiglu(x: jax.Array, layer: dict) -> jax.Array:
    return (jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]


def packed_attention(x, layer, shape: LlamaShape, cos, sin, segment_ids) -> jax.Array:
    """attention() over packed rows: per-token rotary tables [B, T, H/2] (positions restart at
    each document) and a mask that keeps a query inside its own document."""
    b, t, _ = x.shape
    n, h = shape.heads, shape.head_dim

    def rope(y):
        half = y.shape[-1] // 2
        y1, y2 = y[..., :half], y[..., half:]
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        return jnp.concatenate([y1 * c - y2 * s, y2 * c + y1 * s], axis=-1)

    q = rope((x @ layer["wq"]).reshape(b, t, n, h))
    k = rope((x @ layer["wk"]).reshape(b, t, n, h))
    v = (x @ layer["wv"]).reshape(b, t, n, h)
    scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(h)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    visible = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.where(visible[:, None], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bnqk,bknh->bqnh", weights, v).reshape(b, t, n * h)
    return out @ layer["wo"]


def packed_loss(params: dict, batch: dict, shape: LlamaShape) -> jax.Array:
    """Mean cross-entropy over the labelled targets of packed rows (segment_ids, positions)."""
    inv_freq = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)
    angles = batch["positions"].astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = params["embed"][batch["input_ids"]]
    for layer in params["layers"]:
        h = rms_norm(x, layer["attn_norm"], shape.eps)
        x = x + packed_attention(h, layer, shape, cos, sin, batch["segment_ids"])
        x = x + swiglu(rms_norm(x, layer["mlp_norm"], shape.eps), layer)
    logits = (rms_norm(x, params["final_norm"], shape.eps) @ params["lm_head"])[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, jnp.where(mask, targets, 0)[..., None], axis=-1)
    return -(picked[..., 0] * mask).sum() / jnp.maximum(mask.sum(), 1)


def forward(params: dict, input_ids: jax.Array, shape: LlamaShape) -> jax.Array:
    """input_ids [B, T] -> logits [B, T, vocab]."""
    cos, sin = rotary_tables(input_ids.shape[1], shape.head_dim, shape.rope_theta)
    x = params["embed"][input_ids]
    for layer in params["layers"]:
        x = x + attention(rms_norm(x, layer["attn_norm"], shape.eps), layer, shape, cos, sin)
        x = x + swiglu(rms_norm(x, layer["mlp_norm"], shape.eps), layer)
    return rms_norm(x, params["final_norm"], shape.eps) @ params["lm_head"]


def next_token_loss(params: dict, input_ids: jax.Array, shape: LlamaShape) -> jax.Array:
    """Mean cross-entropy of predicting token t + 1 from tokens <= t (no padding here)."""
    logits = forward(params, input_ids, shape)[:, :-1].astype(jnp.float32)
    targets = input_ids[:, 1:]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()


def from_jaxtrain(w: dict, shape: LlamaShape) -> dict:
    """Params from jaxtrain's weights (``nnx.to_pure_dict`` of its Params; fused q/k/v and
    gate/up kernels are split into separate matrices). Used by ``overhead.py --check``."""
    d, n = shape.hidden, shape.heads
    layers = []
    for i in range(shape.layers):
        lw = w["model"]["layers"][i]
        qkv = lw["self_attn"]["qkv_proj"]["kernel"]  # [D, K, 3, H] (K = N heads here)
        gate_up = lw["mlp"]["gate_up_proj"]["kernel"]  # [D, 2, F]
        layers.append(
            {
                "attn_norm": lw["input_layernorm"]["weight"],
                "wq": qkv[:, :, 0].reshape(d, d),
                "wk": qkv[:, :, 1].reshape(d, d),
                "wv": qkv[:, :, 2].reshape(d, d),
                "wo": lw["self_attn"]["o_proj"]["kernel"].reshape(n * shape.head_dim, d),
                "mlp_norm": lw["post_attention_layernorm"]["weight"],
                "w_gate": gate_up[:, 0],
                "w_up": gate_up[:, 1],
                "w_down": lw["mlp"]["down_proj"]["kernel"],
            }
        )
    return {
        "embed": w["model"]["embed_tokens"]["embedding"],
        "layers": layers,
        "final_norm": w["model"]["norm"]["weight"],
        "lm_head": w["lm_head"]["kernel"],
    }

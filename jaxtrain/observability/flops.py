"""Model FLOPs of a decoder-only transformer, counted the way MFU needs them.

Notation (a LlamaConfig's fields): L layers, d hidden size, H query heads, K key/value heads,
Q head dim, I MLP intermediate size, V vocabulary, T the length of a sequence.

Dense part. Every weight matrix W of shape [a, b] costs 2ab FLOPs per token forward (one
multiply, one add) and 4ab backward (gradients for the input and for W): 6ab per token
trained. Summed over the matrices that are multiplied (not the embedding table, which is a
lookup):

    N_matmul = L * (d*Q*(2H + 2K)  +  3*d*I)  +  d*V
                    q,o  k,v          gate,up,down   lm_head
    dense FLOPs per token = 6 * N_matmul

Attention part (the scores QK^T and the weighted sum over V, which hold no parameters). A
query attending to c keys costs 2*Q*c for the scores and 2*Q*c for the sum, per head:
4*H*Q*c forward, 12*H*Q*c trained (backward = 2x forward), in each of L layers:

    attention FLOPs per token = 12 * L * H * Q * c
    causal:          c = (T + 1) / 2   (the mean over positions 1..T of the keys it sees)
    full attention:  c = T
    sliding window w (causal): c = mean over t=1..T of min(t, w)

T is the *actual* length of each sequence (its real, non-padding tokens; for packed rows,
each document), never max_position_embeddings and never the padded length. A batch's model
FLOPs are the sum over its sequences of n * (dense + attention(T=n)) with n the sequence's
real tokens: padding is work the hardware does but the model does not need, so it does not
count towards MFU.

Mixture-of-experts configs (models/moe.py) replace L * 3*d*I by the MLP weights one token is
multiplied by: per sparse layer the router (d*E), k of the E experts (3*d*I_expert each) and
the shared expert if any; dense layers keep 3*d*I.

Models without a Llama-style config fall back to 6 * (number of parameters) per token and no
attention term (an underestimate, said in the log).
"""

from __future__ import annotations

from typing import Any

import numpy as np

LLAMA_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


def has_transformer_shape(config: Any) -> bool:
    return config is not None and all(hasattr(config, f) for f in LLAMA_FIELDS)


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    L = int(config.num_hidden_layers)
    d = int(config.hidden_size)
    H = int(config.num_attention_heads)
    K = int(getattr(config, "num_key_value_heads", None) or H)
    Q = int(getattr(config, "head_dim", None) or d // H)
    I = int(config.intermediate_size)  # noqa: E741 - the paper's name
    V = int(config.vocab_size)
    return L, d, H, K, Q, I, V


def matmul_parameters(config: Any) -> int:
    """N_matmul: parameters that take part in a matrix multiply per token (see module doc)."""
    L, d, H, K, Q, I, V = _dims(config)  # noqa: E741
    active_mlp = getattr(config, "active_mlp_matmul_parameters", None)
    # Mixture-of-experts: only the experts a token is routed to (plus router and shared
    # expert) multiply it, so MFU counts those, not every expert's weights. Otherwise d x I
    # matrices per MLP: 3 for SwiGLU (gate, up, down); a config says otherwise (GPT-2: 2).
    mlp_matrices = int(getattr(config, "mlp_matrices", 3))
    mlp = active_mlp() if callable(active_mlp) else L * mlp_matrices * d * I
    return L * d * Q * (2 * H + 2 * K) + mlp + d * V


def dense_flops_per_token(config: Any) -> float:
    """6 * N_matmul: forward (2) plus backward (4) FLOPs per weight per token."""
    return 6.0 * matmul_parameters(config)


def mean_attended_keys(seq_len: float, *, causal: bool = True, window: int | None = None) -> float:
    """c: the mean number of keys a query attends to in a sequence of seq_len tokens."""
    T = float(seq_len)
    if not causal:
        return T if window is None else float(min(T, 2 * window + 1))
    if window is None or window >= T:
        return (T + 1.0) / 2.0
    # positions 1..w see t keys, positions w+1..T see w keys
    w = float(window)
    return (w * (w + 1.0) / 2.0 + (T - w) * w) / T


def _mean_keys_array(n: np.ndarray, *, causal: bool, window: int | None) -> np.ndarray:
    """`mean_attended_keys` for an array of lengths (all > 0 or 0)."""
    n = np.maximum(n, 1.0)
    if not causal:
        return n if window is None else np.minimum(n, 2.0 * window + 1)
    if window is None:
        return (n + 1.0) / 2.0
    w = float(window)
    return np.where(n <= w, (n + 1.0) / 2.0, (w * (w + 1.0) / 2.0 + (n - w) * w) / n)


def attention_flops_per_token(
    config: Any, seq_len: float, *, causal: bool = True, window: int | None = None
) -> float:
    """12 * L * H * Q * c, with c from `mean_attended_keys`."""
    L, _, H, _, Q, _, _ = _dims(config)
    return 12.0 * L * H * Q * mean_attended_keys(seq_len, causal=causal, window=window)


def flops_per_token(config: Any, seq_len: float, *, causal: bool = True) -> float:
    """Training FLOPs per token of a sequence of seq_len tokens: dense + attention."""
    window = getattr(config, "sliding_window", None)
    return dense_flops_per_token(config) + attention_flops_per_token(
        config, seq_len, causal=causal, window=window
    )


def sequence_lengths(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Real (non-padding) length of every sequence of a host batch; packed rows give one
    length per document (segment_ids), otherwise one per row (attention_mask). Preference
    batches (DPO, reward) add their rejected sequences: the model runs on both sides."""
    if "rejected_input_ids" in batch:
        rejected = {"input_ids": batch["rejected_input_ids"]}
        if "rejected_attention_mask" in batch:
            rejected["attention_mask"] = batch["rejected_attention_mask"]
        chosen = {k: v for k, v in batch.items() if not k.startswith("rejected_")}
        return np.concatenate([sequence_lengths(chosen), sequence_lengths(rejected)])
    ids = np.asarray(batch["input_ids"])
    rows = ids.reshape(-1, ids.shape[-1])
    if "attention_mask" in batch:
        mask = np.asarray(batch["attention_mask"]).reshape(rows.shape) != 0
    else:
        mask = np.ones(rows.shape, bool)
    if "segment_ids" not in batch:
        return mask.sum(axis=-1)
    segments = np.asarray(batch["segment_ids"]).reshape(rows.shape).astype(np.int64)
    # A unique id per (row, segment); padding (mask 0) is left out.
    keys = np.arange(rows.shape[0])[:, None] * (segments.max() + 1) + segments
    _, counts = np.unique(keys[mask], return_counts=True)
    return counts


class FlopsCounter:
    """Model FLOPs of host batches for a model config (see the module doc for the formula)."""

    def __init__(self, config: Any, num_parameters: int, *, causal: bool = True):
        self.config = config
        self.causal = causal
        self.exact = has_transformer_shape(config)
        self.window = getattr(config, "sliding_window", None) if self.exact else None
        self.num_parameters = num_parameters

    def per_token(self, seq_len: float) -> float:
        if not self.exact:
            return 6.0 * self.num_parameters
        return flops_per_token(self.config, seq_len, causal=self.causal)

    def batch_flops(self, batch: dict[str, np.ndarray]) -> float:
        """Sum over sequences of n * (dense + attention(n)), n = the sequence's real tokens."""
        lengths = sequence_lengths(batch).astype(np.float64)
        if not self.exact:
            return 6.0 * self.num_parameters * float(lengths.sum())
        dense = dense_flops_per_token(self.config) * float(lengths.sum())
        L, _, H, _, Q, _, _ = _dims(self.config)
        keys = _mean_keys_array(lengths, causal=self.causal, window=self.window)
        return dense + 12.0 * L * H * Q * float((keys * lengths).sum())

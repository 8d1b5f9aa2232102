"""The log-likelihood of continuations under a causal LM: one compiled, batched step.

A request is (input ids, the index of the first scored position, the continuation's
tokens): the logits at positions first .. first + n - 1 predict the continuation's n
tokens, as lm-eval's Hugging Face backend takes them (right-padded rows under causal
attention: the padding never reaches a real token). Only the scored positions are projected
to the vocabulary (a model with `hidden_states` and `output_projection`, the Llama and GPT-2
families): [B, C, V] logits for C continuation tokens, not [B, T, V] for the whole row.

Shapes are bucketed (rows to the batch size, lengths to powers of two), so a task compiles
a few programs once; the model's state is an argument, so live parameters (an evaluation
during training) reuse them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.serving.steps import bucket

__all__ = ["Scorer"]

SMALLEST_ROW = 16  # tokens: the shortest bucket of input lengths
SMALLEST_CONTINUATION = 4


def _score(graphdef: Any, state: Any, ids, first, length, targets):
    """(sum of log p(target) [B], every target is the argmax [B]) for [B, T] ids."""
    model = nnx.merge(graphdef, state)
    c = targets.shape[1]
    positions = jnp.clip(first[:, None] + jnp.arange(c)[None, :], 0, ids.shape[1] - 1)
    if hasattr(model, "hidden_states") and hasattr(model, "output_projection"):
        hidden = model.hidden_states(ids)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden  # an MoE's (h, aux)
        picked = jnp.take_along_axis(hidden, positions[..., None], axis=1)  # [B, C, D]
        logits = model.output_projection()(picked)
    else:
        logits = jnp.take_along_axis(model(ids), positions[..., None], axis=1)
    logits = logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    scored = jnp.arange(c)[None, :] < length[:, None]
    greedy = (jnp.argmax(logits, axis=-1) == targets) | ~scored
    return jnp.where(scored, target_logp, 0.0).sum(-1), greedy.all(-1)


class Scorer:
    """Scores requests in batches of `rows` on the model's devices (`sharding`: where the
    rows go, None = beside the model's parameters)."""

    def __init__(self, graphdef: Any, *, rows: int, max_length: int, sharding: Any = None):
        self.rows, self.max_length, self.sharding = rows, max_length, sharding
        self._step = jax.jit(functools.partial(_score, graphdef))
        self.shapes: set[tuple[int, int]] = set()  # (T, C) compiled so far

    def __call__(
        self, state: Any, requests: Sequence[tuple[list[int], int, list[int]]], pad_id: int
    ) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each (ids, first scored position, continuation)."""
        out: list[tuple[float, bool]] = []
        if not requests:
            return out
        # One continuation length for the whole call (they are short): fewer programs.
        longest = max(len(cont) for _, _, cont in requests)
        c = bucket(longest, SMALLEST_CONTINUATION, self.max_length)
        for lo in range(0, len(requests), self.rows):
            out += self._batch(state, requests[lo : lo + self.rows], pad_id, c)
        return out

    def _batch(self, state, batch, pad_id: int, c: int) -> list[tuple[float, bool]]:
        t = bucket(max(len(ids) for ids, _, _ in batch), SMALLEST_ROW, self.max_length)
        ids = np.full((self.rows, t), pad_id, np.int32)
        first = np.zeros(self.rows, np.int32)
        length = np.zeros(self.rows, np.int32)
        targets = np.zeros((self.rows, c), np.int32)
        for r, (row, start, cont) in enumerate(batch):
            ids[r, : len(row)], first[r], length[r] = row, start, len(cont)
            targets[r, : len(cont)] = cont
        arrays = [jnp.asarray(a) for a in (ids, first, length, targets)]
        if self.sharding is not None:
            arrays = [jax.device_put(a, self.sharding(a.ndim)) for a in arrays]
        self.shapes.add((t, c))
        logp, greedy = self._step(state, *arrays)
        logp, greedy = np.asarray(logp), np.asarray(greedy)
        return [(float(logp[r]), bool(greedy[r])) for r in range(len(batch))]

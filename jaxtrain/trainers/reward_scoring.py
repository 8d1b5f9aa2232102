"""A reward model as a GRPO reward function: `reward_model(path_or_model, tokenizer)`.

The model is a `RewardModel` or the directory `RewardTrainer.save_pretrained` exported (a
transformers `*ForSequenceClassification` directory: the backbone without its LM head, and
`score.weight`). Each prompt + completion is encoded as the pair trainers encode a response
(`trainers.data.encode_scored_response`) and scored at its last real token, compiled once per
length bucket (powers of two up to `max_length`), on the default device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.trainers.data import encode_scored_response
from jaxtrain.trainers.reward import RewardModel

__all__ = ["load_reward_model", "reward_model"]


class _NoTensor:
    """A zero tensor source for the LM head that reward exports drop: RewardModel never
    uses it, but the causal-LM loader fills every parameter the config describes."""

    def __init__(self, shape: tuple[int, ...], path: Path):
        self._shape, self.path = shape, path

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape

    def get(self, name: str) -> np.ndarray:
        return np.zeros(self._shape, np.float32)

    def release(self, name: str) -> None:
        """Nothing is mapped."""


def load_reward_model(path: str | Path, *, dtype: Any = jnp.float32) -> RewardModel:
    """The RewardModel of a directory written by `RewardTrainer.save_pretrained`."""
    from jaxtrain.hf.load import open_weights, read_config
    from jaxtrain.hf.params import load_weights

    path = Path(path)
    family, config = read_config(path, "causal-lm", None)
    tensors = dict(open_weights(path))
    score = tensors.pop("score.weight", None)
    if score is None:
        raise ArgumentError(
            f"{path} has no score.weight: not a reward model (export one with "
            "RewardTrainer.save_pretrained)."
        )
    score_w = np.asarray(score.get("score.weight"), np.float32)  # [1, D]
    if not getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = _NoTensor((config.vocab_size, config.hidden_size), path)
    backbone = load_weights(family, config, tensors, source=path, dtype=dtype, param_dtype=dtype)
    model = RewardModel(backbone)
    model.score.set_value(jnp.asarray(score_w.T, dtype))
    return model


def _bucket(longest: int, max_length: int) -> int:
    """Padded length: the next power of two (at least 16), so few shapes compile."""
    return min(max_length, max(16, 1 << (longest - 1).bit_length()))


def reward_model(
    model: str | Path | RewardModel,
    tokenizer: Any = None,
    *,
    max_length: int = 1024,
    batch_size: int = 64,
    chat_template: str | None = None,
    name: str | None = None,
) -> Callable[..., list[float]]:
    """A reward function `fn(prompts, completions, **columns) -> list[float]` whose values
    are `model`'s scores of prompt + completion (a RewardModel or an exported directory;
    `tokenizer` defaults to the directory's). Rows longer than `max_length` keep their
    end (the completion); `batch_size` rows are scored per call of the compiled model."""
    if isinstance(model, (str, Path)):
        label = name or Path(model).name
        if tokenizer is None:
            from jaxtrain.hf.load import load_tokenizer

            tokenizer = load_tokenizer(model)
        model = load_reward_model(model)
    else:
        label = name or type(model).__name__
    if not isinstance(model, RewardModel):
        raise ArgumentError(
            f"reward_model needs a RewardModel or an exported reward directory, got "
            f"{type(model).__name__}"
        )
    if tokenizer is None:
        raise ArgumentError("reward_model needs the reward model's tokenizer.")
    pad = int(getattr(tokenizer, "pad_token_id", None) or 0)
    graphdef, state = nnx.split(model)

    @jax.jit
    def scores(state: Any, ids: jax.Array, mask: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(ids, mask)

    def score(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float]:
        rows = [
            encode_scored_response(tokenizer, p, c, max_length, chat_template)
            for p, c in zip(prompts, completions, strict=True)
        ]
        out: list[float] = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            t = _bucket(max(len(r) for r in chunk), max_length)
            ids = np.full((batch_size, t), pad, np.int32)  # a fixed batch: one compile
            mask = np.zeros((batch_size, t), np.int32)
            for i, r in enumerate(chunk):
                ids[i, : len(r)], mask[i, : len(r)] = r, 1
            mask[len(chunk) :, 0] = 1  # filler rows: scored at position 0, dropped
            values = np.asarray(scores(state, jnp.asarray(ids), jnp.asarray(mask)))
            out.extend(float(v) for v in values[: len(chunk)])
        return out

    score.__name__ = f"reward_model({label})"
    return score

"""Reward models: a scalar head on a causal LM, trained on preference pairs.

Bradley-Terry loss per pair: -log sigmoid(r(chosen) - r(rejected) - margin), with `margin`
the dataset's optional column (0 without it). The score of a sequence is the head applied to
the final hidden state of its last real token, which is what transformers'
`*ForSequenceClassification` models do, so `RewardTrainer.save_pretrained` writes a
directory that `AutoModelForSequenceClassification.from_pretrained` loads with the same
scores (num_labels=1, the LM head dropped, the tokenizer's pad token in the config).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.arguments import ArgumentError
from jaxtrain.models.attention import padding_segments
from jaxtrain.models.lora import merge_lora
from jaxtrain.state import TrainState
from jaxtrain.trainers.base import (
    PairTrainer,
    TaskStart,
    concrete_model,
    pair_normalizer,
)
from jaxtrain.trainers.frozen import TaskModel, freeze
from jaxtrain.trainers.sequences import is_packed, real_units, unit_count
from jaxtrain.training.program import Objective

__all__ = [
    "REWARD_OBJECTIVE",
    "RewardModel",
    "RewardTrainer",
    "reward_loss_sums",
    "save_reward_model",
]


class RewardModel(nnx.Module):
    """`backbone` (a LlamaForCausalLM) without its LM head, plus a scalar `score` head.

    ``model(input_ids, attention_mask)`` -> scores [B] at each row's last real token.
    """

    # The score head stays trainable when LoRA freezes the rest (models/lora.py).
    lora_keep = ("score",)

    def __init__(self, backbone: nnx.Module, *, seed: int = 0):
        config = backbone.config
        self.backbone = backbone
        self.config = config
        if backbone.lm_head is not None:
            freeze(backbone.lm_head)  # unused: neither trained nor in the optimizer state
        std = getattr(config, "initializer_range", 0.02)
        init = jax.random.normal(jax.random.key(seed), (config.hidden_size, 1)) * std
        self.score = nnx.Param(init.astype(backbone.param_dtype), logical_axes=("embed", None))

    @property
    def remat_policy(self) -> Any:
        return self.backbone.remat_policy

    @remat_policy.setter
    def remat_policy(self, policy: Any) -> None:
        self.backbone.remat_policy = policy

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        # Right-padded rows: the padding's marks let blockwise attention skip it (as in the
        # other padded losses); real tokens' states, and so the scores, do not change.
        hidden = self.backbone.hidden_states(
            input_ids, segment_ids=padding_segments(attention_mask)
        )
        last = jnp.max(jnp.arange(t) * (attention_mask != 0), axis=-1)
        h_BxD = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return (h_BxD.astype(jnp.float32) @ self.score[...].astype(jnp.float32))[:, 0]

    def packed_scores(self, batch: dict[str, jax.Array], count: int) -> jax.Array:
        """Scores [count] of the sequences of a packed batch (trainers/packed.py): the head at
        each sequence's last token, from rows whose sequences are isolated by segment."""
        hidden = self.backbone.hidden_states(
            batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"]
        )
        # The head is one column: score every token (cheap), then gather the last ones.
        token_scores = (hidden.astype(jnp.float32) @ self.score[...].astype(jnp.float32))[..., 0]
        flat = jnp.arange(token_scores.size).reshape(token_scores.shape)
        flat = jnp.where(batch["segment_ids"] > 0, flat, -1)
        index = batch["sequence_index"].reshape(-1)
        last = jax.ops.segment_max(flat.reshape(-1), index, num_segments=count)
        return token_scores.reshape(-1)[jnp.maximum(last, 0)]


def reward_loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
    """Bradley-Terry sums over a batch of pairs scored by `model.model` (a RewardModel)."""
    del rng
    n = unit_count(batch)
    if is_packed(batch):
        scores = model.model.packed_scores(batch, 2 * n)
    else:
        ids = jnp.concatenate([batch["input_ids"], batch["rejected_input_ids"]])
        mask = jnp.concatenate([batch["attention_mask"], batch["rejected_attention_mask"]])
        scores = model.model(ids, mask)
    chosen, rejected = scores[:n], scores[n:]
    margin = batch.get("margin", jnp.zeros_like(chosen))
    losses = -jax.nn.log_sigmoid(chosen - rejected - margin)
    real = real_units(batch)
    won = (chosen > rejected).astype(jnp.float32) * real
    return {
        "loss_sum": (losses * real).sum(),
        "tokens": real.sum(),
        "correct": won.sum(),
        "rewards/chosen_sum": (jax.lax.stop_gradient(chosen) * real).sum(),
        "rewards/rejected_sum": (jax.lax.stop_gradient(rejected) * real).sum(),
        "rewards/margins_sum": (jax.lax.stop_gradient(chosen - rejected) * real).sum(),
    }


REWARD_OBJECTIVE = Objective(
    loss_sums=reward_loss_sums, normalizer=pair_normalizer, token_nll=False
)


class RewardTrainer(PairTrainer):
    """Train a reward model on (prompt, chosen, rejected) pairs (Bradley-Terry).

    `model` is a causal LM (a RewardModel is built around it) or a RewardModel. Logged per
    pair: loss, accuracy (chosen scored above rejected), rewards/chosen, rewards/rejected,
    rewards/margins.
    """

    def __init__(self, arguments: Any = None, model: Any = None, **kwargs: Any):
        from jaxtrain.arguments import TrainingArguments

        args = arguments if arguments is not None else TrainingArguments()
        start = TaskStart.resolve(args, kwargs)
        model = concrete_model(model, start.settings.model, start.runtime)
        if not isinstance(model, RewardModel):
            model = RewardModel(model, seed=start.settings.model.seed)
        super().__init__(
            **start.trainer_kwargs(
                arguments=args, model=TaskModel(model), objective=REWARD_OBJECTIVE
            )
        )

    def save_pretrained(
        self,
        state: TrainState,
        save_directory: str | Path,
        *,
        lora_format: str = "merged",
        **kwargs: Any,
    ) -> Path:
        """Write a transformers `*ForSequenceClassification` directory (num_labels=1); LoRA
        adapters are merged into the weights."""
        if lora_format != "merged":
            raise ArgumentError("RewardTrainer exports merged weights only (lora_format='merged').")
        kwargs.setdefault("tokenizer", self.processing_class)
        kwargs.setdefault("chat_template", self.settings.data.chat_template)  # the run's one
        return save_reward_model(
            self.model_from_state(state), save_directory, pad_token_id=self.pad_token_id, **kwargs
        )


def save_reward_model(
    reward: RewardModel, save_directory: str | Path, *, pad_token_id: int | None, **kwargs: Any
) -> Path:
    """`reward` as a transformers `*ForSequenceClassification` directory (num_labels=1, LoRA
    merged, the LM head dropped); kwargs go to `jaxtrain.hf.save_pretrained`."""
    from safetensors.numpy import load_file, save_file

    from jaxtrain.hf import save_pretrained

    # Adapters folded in, every weight (the unused LM head too) a Param for the writer.
    backbone = merge_lora(reward.backbone)
    out = Path(save_directory)
    kwargs["max_shard_size"] = "1000GB"  # one file: the head is added below
    with tempfile.TemporaryDirectory() as tmp:
        written = save_pretrained(backbone, tmp, **kwargs)
        if jax.process_index() != 0:
            return out
        out.mkdir(parents=True, exist_ok=True)
        tensors = load_file(str(written / "model.safetensors"))
        tensors.pop("lm_head.weight", None)
        score = np.asarray(jax.device_get(reward.score[...]))
        tensors["score.weight"] = np.ascontiguousarray(
            score.T.astype(tensors[next(iter(tensors))].dtype)
        )
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((written / "config.json").read_text())
        config["architectures"] = [
            a.replace("ForCausalLM", "ForSequenceClassification") for a in config["architectures"]
        ]
        config.update(
            num_labels=1,
            id2label={"0": "LABEL_0"},
            label2id={"LABEL_0": 0},
            pad_token_id=pad_token_id,
        )
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for extra in written.iterdir():  # tokenizer files and the model card
            skip = ("model.safetensors", "config.json", "generation_config.json")
            if extra.is_file() and extra.name not in skip:
                (out / extra.name).write_bytes(extra.read_bytes())
    return out

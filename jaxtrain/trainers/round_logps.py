"""The compiled passes over a generated round's rows: the trainer's log-probs of the sampled
tokens under the parameters that sampled them (the later updates' old log-probs, what the
sampler's are compared with), and that comparison with its importance weights
(grpo_agreement.py)."""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from jaxtrain.parallel.batch import BatchLayout
from jaxtrain.trainers.grpo_agreement import round_agreement
from jaxtrain.training.logps import model_token_logps

__all__ = ["RoundLogps"]


class RoundLogps:
    """Compiled at first use; `args` a RolloutArguments, `layout` the batch's on the mesh."""

    def __init__(self, args: Any, layout: BatchLayout):
        self.args, self.layout = args, layout
        self._trainer_fn: Any = None
        self._agreement_fn: Any = None

    def trainer(self, program: Any, state: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """[A, M, T - 1] log-probs (after the temperature) of `batch`'s tokens under `state`'s
        policy; 0 where a label is ignored."""
        if self._trainer_fn is None:
            graphdef, t = program.graphdef, self.args.temperature

            @jax.jit
            def trainer_logps(params, rest, ids, labels, images):
                model = nnx.merge(graphdef, params, rest).model
                flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
                if images is not None:  # [A, M, K, C, H, W] -> the rows' [A * M, K, ...]
                    images = images.reshape(-1, *images.shape[2:])
                logps, _ = model_token_logps(
                    model, flat(ids), flat(labels), temperature=t, pixel_values=images
                )
                return logps.reshape(*ids.shape[:2], -1)

            self._trainer_fn = trainer_logps
        out = self._trainer_fn(
            state.params, program.frozen_state(), batch["input_ids"], batch["labels"],
            batch.get("pixel_values"),
        )  # fmt: skip
        return jax.device_put(out, self.layout.sharding(3, micro_axis=True))

    def agreement(
        self, trainer_logps: jax.Array, sampler_logps: jax.Array, labels: jax.Array
    ) -> tuple[jax.Array | None, dict[str, float]]:
        """The sampler correction's weights [A, M, T - 1] (None without a correction) and the
        round's agreement logs (grpo_agreement.py), over its scored completion tokens."""
        if self._agreement_fn is None:
            args = self.args
            self._agreement_fn = jax.jit(
                functools.partial(
                    round_agreement,
                    mode=args.sampler_correction,
                    low=args.sampler_correction_min,
                    high=args.sampler_correction_max,
                )
            )
        weight, logs = self._agreement_fn(trainer_logps, sampler_logps, labels)
        if weight is not None:
            weight = jax.device_put(weight, self.layout.sharding(3, micro_axis=True))
        return weight, {k: float(v) for k, v in logs.items()}

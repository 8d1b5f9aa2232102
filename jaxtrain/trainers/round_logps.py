"""The compiled passes over a generated round's rows: the trainer's log-probs of the sampled
tokens under the parameters that sampled them (the later updates' old log-probs, what the
sampler's are compared with), and that comparison with its importance weights
(grpo_agreement.py); of a mixture-of-experts policy, how often the trainer routes a token to
the experts the sampler did."""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from jaxtrain.config.sections import RunSettings
from jaxtrain.parallel.batch import BatchLayout
from jaxtrain.trainers.grpo_agreement import round_agreement, routing_agreement
from jaxtrain.training.logps import model_token_logps

__all__ = ["RoundLogps"]


class RoundLogps:
    """Compiled at first use; `settings` the run's (a rollout task's), `layout` the batch's on
    the mesh."""

    def __init__(self, settings: RunSettings, layout: BatchLayout):
        self.settings, self.layout = settings, layout
        self._trainer_fn: Any = None
        self._agreement_fn: Any = None
        self._routing_fn: Any = None

    def trainer(self, program: Any, state: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """[A, M, T - 1] log-probs (after the temperature) of `batch`'s tokens under `state`'s
        policy (with routing_replay, through the sampler's experts); 0 where a label is
        ignored."""
        if self._trainer_fn is None:
            graphdef, t = program.graphdef, self.settings.task.temperature

            @jax.jit
            def trainer_logps(params, rest, ids, labels, images, routing):
                model = nnx.merge(graphdef, params, rest).model
                logps, _ = model_token_logps(
                    model, _rows(ids), _rows(labels), temperature=t, pixel_values=_rows(images),
                    routing=_rows(routing),
                )  # fmt: skip
                return logps.reshape(*ids.shape[:2], -1)

            self._trainer_fn = trainer_logps
        routing = batch.get("routing") if self.settings.task.routing_replay else None
        out = self._trainer_fn(
            state.params, program.frozen_state(), batch["input_ids"], batch["labels"],
            batch.get("pixel_values"), routing,
        )  # fmt: skip
        return jax.device_put(out, self.layout.sharding(3, micro_axis=True))

    def routing(self, program: Any, state: Any, batch: dict[str, jax.Array]) -> dict[str, float]:
        """The share of tokens the trainer routes, in `state`'s policy, to the experts the
        sampler did (`batch["routing"]`): grpo_agreement.routing_agreement's logs."""
        if self._routing_fn is None:
            graphdef = program.graphdef

            @jax.jit
            def agreement(params, rest, ids, sampler):
                model = nnx.merge(graphdef, params, rest).model
                _, trainer = model.hidden_states(_rows(ids), return_routing=True)
                return routing_agreement(trainer, _rows(sampler))

            self._routing_fn = agreement
        logs = self._routing_fn(
            state.params, program.frozen_state(), batch["input_ids"], batch["routing"]
        )
        return {k: float(v) for k, v in logs.items()}

    def agreement(
        self, trainer_logps: jax.Array, sampler_logps: jax.Array, labels: jax.Array
    ) -> tuple[jax.Array | None, dict[str, float]]:
        """The sampler correction's weights [A, M, T - 1] (None without a correction) and the
        round's agreement logs (grpo_agreement.py), over its scored completion tokens."""
        if self._agreement_fn is None:
            settings = self.settings
            self._agreement_fn = jax.jit(
                functools.partial(
                    round_agreement,
                    mode=settings.task.sampler_correction,
                    low=settings.task.sampler_correction_min,
                    high=settings.task.sampler_correction_max,
                )
            )
        weight, logs = self._agreement_fn(trainer_logps, sampler_logps, labels)
        if weight is not None:
            weight = jax.device_put(weight, self.layout.sharding(3, micro_axis=True))
        return weight, {k: float(v) for k, v in logs.items()}


def _rows(x: jax.Array | None) -> jax.Array | None:
    """A round's [A, M, ...] arrays as rows [A * M, ...] (None stays None)."""
    return None if x is None else x.reshape(-1, *x.shape[2:])

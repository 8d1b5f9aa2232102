"""KTO (Ethayarajh et al. 2024, "Model Alignment as Prospect Theoretic Optimization").

Unpaired data: each example is a completion marked desirable or undesirable. With
r = log pi(y|x) - log ref(y|x) (sums over the completion's tokens) and z the KL estimate

    z = max(0, mean over the micro-batch of [log pi(y'|x) - log ref(y'|x)]),

y' the completion of another example of the micro-batch (kto_data.py, no gradient), the
per-example losses are

- kto:                desirable  w_d (1 - sigmoid(beta (r - z))),
                      undesirable w_u (1 - sigmoid(beta (z - r)));
- apo_zero_unpaired:  desirable  w_d (1 - sigmoid(beta r)), undesirable w_u sigmoid(beta r)
                      (no KL estimate: no mismatched sequences are built or run),

and the loss of an update is their sum over the global batch divided by its examples (as
TRL's mean over the batch). The KL estimate is per micro-batch: over every device's rows of
it, as TRL's is gathered over its ranks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config.sections import RunSettings
from jaxtrain.task_arguments import KTO_LOSS_TYPES, KTOArguments
from jaxtrain.trainers.base import (
    TaskStart,
    TaskTrainer,
    concrete_model,
    dataset_columns,
    packed_train_source,
    pair_normalizer,
    task_arguments,
    task_pad_token_id,
)
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.kto_data import KTOCollator, KTOFeaturizer, is_paired, unpair_preferences
from jaxtrain.trainers.packed import KTOLayout
from jaxtrain.trainers.sequences import KL_SIDES, real_units, sequence_logps, unit_count
from jaxtrain.training.program import Objective

__all__ = ["KTOArguments", "KTOTrainer", "kto_losses", "kto_objective", "unpair_preferences"]


def kto_losses(
    logratios: jax.Array,
    desirable: jax.Array,
    kl: jax.Array,
    *,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> jax.Array:
    """Per-example weighted losses from log pi - log ref [N], desirable [N] (bool) and the KL
    estimate (a scalar, ignored by apo_zero_unpaired)."""
    if loss_type == "kto":
        good = 1 - jax.nn.sigmoid(beta * (logratios - kl))
        bad = 1 - jax.nn.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        good = 1 - jax.nn.sigmoid(beta * logratios)
        bad = jax.nn.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; use one of {KTO_LOSS_TYPES}")
    return jnp.where(desirable, desirable_weight * good, undesirable_weight * bad)


def kto_loss_sums(
    policy: Any, reference: Any, batch: dict[str, jax.Array], task: Any
) -> dict[str, jax.Array]:
    """The objective's sums over a batch of examples (per example; entropy per token, the
    rewards and log-probs of each kind per example of that kind); `task`: KTOArguments'
    section (beta, loss_type, desirable_weight, undesirable_weight)."""
    n = unit_count(batch)
    with_kl = task.loss_type == "kto"
    sides = KL_SIDES if with_kl else KL_SIDES[:1]
    stop = jax.lax.stop_gradient
    policy_s = sequence_logps(policy, batch, sides, entropy=True)
    ref_s = sequence_logps(reference, batch, sides)
    logps = policy_s.side("logps", 0, n)
    ref_logps = stop(ref_s.side("logps", 0, n))
    real = real_units(batch)
    desirable = (batch["label"] > 0.5).astype(jnp.float32) * real
    undesirable = real - desirable
    kl = jnp.zeros((), jnp.float32)
    if with_kl:  # no gradient through the estimate (TRL's no_grad)
        kl_terms = stop(policy_s.side("logps", 1, n) - ref_s.side("logps", 1, n))
        kl = jnp.maximum((kl_terms * real).sum() / jnp.maximum(real.sum(), 1.0), 0.0)
    logratios = logps - ref_logps
    losses = kto_losses(
        logratios,
        desirable > 0,
        kl,
        beta=task.beta,
        loss_type=task.loss_type,
        desirable_weight=task.desirable_weight,
        undesirable_weight=task.undesirable_weight,
    )
    rewards = task.beta * stop(logratios)
    tokens = (policy_s.side("tokens", 0, n) * real).sum()
    return {
        "loss_sum": (losses * real).sum(),
        "tokens": real.sum(),
        "kl_sum": kl * real.sum(),
        "entropy_sum": stop((policy_s.side("entropy", 0, n) * real).sum()),
        "entropy_count": tokens,
        "rewards/chosen_sum": (rewards * desirable).sum(),
        "rewards/chosen_count": desirable.sum(),
        "rewards/rejected_sum": (rewards * undesirable).sum(),
        "rewards/rejected_count": undesirable.sum(),
        "logps/chosen_sum": (stop(logps) * desirable).sum(),
        "logps/chosen_count": desirable.sum(),
        "logps/rejected_sum": (stop(logps) * undesirable).sum(),
        "logps/rejected_count": undesirable.sum(),
    }


def kto_objective(settings: RunSettings) -> Objective:
    """KTO's objective on a TaskModel whose `reference` is the frozen reference."""

    def loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        return kto_loss_sums(model.model, model.reference, batch, settings.task)

    return Objective(
        loss_sums=loss_sums,
        normalizer=pair_normalizer,
        token_nll=False,
        # The examples are unpaired: the margin is a difference of the two kinds' means.
        differences=(("rewards/margins", "rewards/chosen", "rewards/rejected"),),
    )


class KTOTrainer(TaskTrainer):
    """Train a policy on unpaired (prompt, completion, label) rows with KTO.

    `reference_model=None` freezes a copy of `model` as it is now. Preference pairs are
    unpaired (chosen desirable, rejected not). Logged: loss (per example), kl, entropy (per
    completion token), rewards/chosen, logps/chosen (per desirable example),
    rewards/rejected, logps/rejected (per undesirable example), rewards/margins (the
    difference of the two rewards, as TRL logs it).
    """

    def __init__(
        self,
        arguments: KTOArguments | None = None,
        model: Any = None,
        reference_model: Any = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ):
        args = task_arguments(arguments, KTOArguments, type(self).__name__)
        start = TaskStart.resolve(args, kwargs)
        settings, runtime, data = start.settings, start.runtime, start.settings.data
        model = concrete_model(model, settings.model, runtime)
        reference = (
            concrete_model(reference_model, settings.model, runtime)
            if reference_model is not None
            else nnx.clone(model)
        )
        dataset_train, dataset_eval = (
            unpair_preferences(d) if d is not None and is_paired(dataset_columns(d)) else d
            for d in (dataset_train, dataset_eval)
        )
        kl = settings.task.loss_type == "kto"  # apo_zero_unpaired needs no mismatched sequences
        collator = kwargs.get("data_collator")
        pad = task_pad_token_id(processing_class, model)
        if collator is None:
            # The KL rows rotate within each micro-batch's rows on this process.
            group = data.micro_batch_size // runtime.process_count
            collator = KTOCollator(data.seq_len, pad, group=group, kl=kl)
        source = kwargs.get("train_source")
        if data.packing:
            featurizer = KTOFeaturizer(
                name="dataset_train",
                tokenizer=processing_class,
                max_length=data.seq_len,
                chat_template=data.chat_template,
            )
            layout = KTOLayout(data.seq_len, kl)
            source = packed_train_source(
                dataset_train,
                data,
                runtime,
                featurizer,
                lambda _: layout,
                "examples",
                pad_token_id=pad,
                given_source=source,
                given_collator=kwargs.get("data_collator"),
            )
        super().__init__(
            **start.trainer_kwargs(
                arguments=args,
                model=TaskModel(model, reference=reference),
                dataset_train=dataset_train,
                dataset_eval=dataset_eval,
                processing_class=processing_class,
                objective=kto_objective(settings),
                data_collator=collator,
                train_source=source,
            )
        )

    def create_featurizer(self, name: str) -> KTOFeaturizer:
        return KTOFeaturizer(
            name=name,
            tokenizer=self.processing_class,
            max_length=self.settings.data.seq_len,
            chat_template=self.settings.data.chat_template,
        )

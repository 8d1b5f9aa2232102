"""Direct Preference Optimization (Rafailov et al. 2023) on the base Trainer.

With h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)), log
probabilities summed over each response's tokens, the per-pair losses are

- sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps: label_smoothing)
- ipo:     (h' - 1 / (2 beta))^2, h' built from log-probs averaged over the response tokens
- hinge:   max(0, 1 - beta h)

The reference is a frozen model (a copy of the policy at the start by default: no gradient,
no optimizer state, an argument of the compiled step), or log-probs precomputed once and
stored in the dataset (`reference_chosen_logps`, `reference_rejected_logps`), or nothing at
all (`reference_free`: ref = 0). Policy and reference see chosen and rejected in one batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.config.sections import RunSettings
from jaxtrain.data.errors import DatasetError
from jaxtrain.models.lora import adapters_off
from jaxtrain.task_arguments import DPO_LOSS_TYPES, DPOArguments
from jaxtrain.trainers.base import (
    PairTrainer,
    TaskStart,
    add_columns,
    concrete_model,
    dataset_columns,
    pair_normalizer,
    task_arguments,
)
from jaxtrain.trainers.data import PairCollator, PairFeaturizer
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.sequences import (
    PAIR_SIDES,
    preference_sums,
    real_units,
    sequence_logps,
    unit_count,
)
from jaxtrain.training.program import Objective

__all__ = [
    "DPOArguments",
    "DPOTrainer",
    "dpo_loss_sums",
    "dpo_losses",
    "dpo_objective",
    "reference_logps",
]

LOSS_TYPES = DPO_LOSS_TYPES
REFERENCE_COLUMNS = ("reference_chosen_logps", "reference_rejected_logps")


def dpo_losses(
    chosen: jax.Array,
    rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> jax.Array:
    """Per-pair losses from (policy, reference) log-probs of chosen and rejected ([N] each)."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * jax.nn.log_sigmoid(
            beta * h
        ) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * h)
    raise ValueError(f"unknown DPO loss_type {loss_type!r}; use one of {LOSS_TYPES}")


def pair_logps(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """(chosen logps, rejected logps, chosen tokens, rejected tokens), each [N], from one
    forward over both sides (padded or packed: trainers/sequences.py)."""
    n = unit_count(batch)
    s = sequence_logps(model, batch, PAIR_SIDES)
    return (
        s.side("logps", 0, n),
        s.side("logps", 1, n),
        s.side("tokens", 0, n),
        s.side("tokens", 1, n),
    )


def dpo_loss_sums(
    policy: Any,
    reference: Any,
    batch: dict[str, jax.Array],
    task: Any,
    reference_logps: tuple[jax.Array, jax.Array] | None = None,
) -> dict[str, jax.Array]:
    """The objective's sums over a batch of pairs (per pair: loss, rewards, log-probs);
    `task`: DPOArguments' section (beta, loss_type, label_smoothing).

    The reference log-probs are the batch's precomputed columns when present, else
    ``reference``'s (no gradient), else 0 (reference-free).
    """
    chosen, rejected, chosen_n, rejected_n = pair_logps(policy, batch)
    if reference_logps is not None:  # computed by the caller (LoRA: the base without adapters)
        ref_chosen, ref_rejected = (jax.lax.stop_gradient(x) for x in reference_logps)
    elif "reference_chosen_logps" in batch:
        ref_chosen = batch["reference_chosen_logps"]
        ref_rejected = batch["reference_rejected_logps"]
    elif reference is not None:
        ref = pair_logps(reference, batch)
        ref_chosen, ref_rejected = jax.lax.stop_gradient(ref[0]), jax.lax.stop_gradient(ref[1])
    else:  # reference_free
        ref_chosen = ref_rejected = jnp.zeros_like(chosen)
    if task.loss_type == "ipo":  # IPO compares mean per-token log-probs
        c_n, r_n = jnp.maximum(chosen_n, 1.0), jnp.maximum(rejected_n, 1.0)
        terms = (chosen / c_n, rejected / r_n, ref_chosen / c_n, ref_rejected / r_n)
    else:
        terms = (chosen, rejected, ref_chosen, ref_rejected)
    losses = dpo_losses(
        *terms, beta=task.beta, loss_type=task.loss_type, label_smoothing=task.label_smoothing
    )
    real = real_units(batch)
    reward_chosen = task.beta * jax.lax.stop_gradient(chosen - ref_chosen)
    reward_rejected = task.beta * jax.lax.stop_gradient(rejected - ref_rejected)
    return {
        "loss_sum": (losses * real).sum(),
        **preference_sums(reward_chosen, reward_rejected, chosen, rejected, real),
    }


def dpo_objective(settings: RunSettings) -> Objective:
    """DPO's objective on a TaskModel (`reference`: the frozen reference, or None when the
    batch holds precomputed reference log-probs or the loss is reference-free)."""
    task, lora = settings.task, bool(settings.model.lora_rank)

    def loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        ref = None
        base_is_reference = (
            model.reference is None
            and lora
            and not task.reference_free
            and "reference_chosen_logps" not in batch
        )
        if base_is_reference:  # LoRA: the reference is the policy without its adapters
            with adapters_off(model.model) as base:
                ref = pair_logps(base, batch)[:2]
        return dpo_loss_sums(model.model, model.reference, batch, task, ref)

    return Objective(loss_sums=loss_sums, normalizer=pair_normalizer, token_nll=False)


class DPOTrainer(PairTrainer):
    """Train a policy on (prompt, chosen, rejected) pairs with the DPO family of losses.

    `reference_model=None` freezes a copy of `model` as it is now. Logged (through the
    objective's sums, per pair): loss, accuracy (= rewards/accuracies), rewards/chosen,
    rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected.
    """

    def __init__(
        self,
        arguments: DPOArguments | None = None,
        model: Any = None,
        reference_model: Any = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        processing_class: Any = None,
        **kwargs: Any,
    ):
        args = task_arguments(arguments, DPOArguments, type(self).__name__)
        start = TaskStart.resolve(args, kwargs)
        settings, task = start.settings, start.settings.task
        model = concrete_model(model, settings.model, start.runtime)
        reference = None
        # With LoRA and no reference given, the reference is the policy's own base without
        # its adapters (no second copy of the weights: with --quantization, the one quantized
        # base serves both).
        base_is_reference = bool(settings.model.lora_rank) and reference_model is None
        if not task.reference_free:
            if reference_model is not None:
                reference = concrete_model(reference_model, settings.model, start.runtime)
            elif not base_is_reference:
                reference = nnx.clone(model)
            if task.precompute_reference_logps:  # before LoRA: `model` is the base itself
                dataset_train, dataset_eval = (
                    with_reference_logps(reference or model, d, processing_class, settings, name)
                    for d, name in (
                        (dataset_train, "dataset_train"),
                        (dataset_eval, "dataset_eval"),
                    )
                )
            # With the log-probs stored in every dataset the reference is not needed.
            stored = [
                all(c in dataset_columns(d) for c in REFERENCE_COLUMNS)
                for d in (dataset_train, dataset_eval)
                if d is not None
            ]
            if stored and all(stored):
                reference = None
            elif any(stored):
                raise DatasetError(
                    "dataset_train and dataset_eval must both hold reference_chosen_logps and "
                    "reference_rejected_logps, or neither"
                )
        super().__init__(
            **start.trainer_kwargs(
                arguments=args,
                model=TaskModel(model, reference=reference),
                dataset_train=dataset_train,
                dataset_eval=dataset_eval,
                processing_class=processing_class,
                objective=dpo_objective(settings),
            )
        )


def with_reference_logps(
    reference: nnx.Module, dataset: Any, tokenizer: Any, settings: RunSettings, name: str
) -> Any:
    """`dataset` with its rows' reference log-probs as columns (unchanged when it has them)."""
    if dataset is None or all(c in dataset_columns(dataset) for c in REFERENCE_COLUMNS):
        return dataset
    columns = reference_logps(
        reference,
        dataset,
        tokenizer=tokenizer,
        max_length=settings.data.seq_len,
        batch_size=settings.data.eval_batch_size,
        chat_template=settings.data.chat_template,
        pad_token_id=_pad_id(tokenizer, reference),
        name=name,
    )
    return add_columns(dataset, columns)


def _pad_id(tokenizer: Any, model: Any) -> int:
    for source in (tokenizer, getattr(model, "config", None)):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    return 0


def reference_logps(
    reference: nnx.Module,
    dataset: Any,
    *,
    tokenizer: Any,
    max_length: int,
    batch_size: int = 8,
    chat_template: str | None = None,
    pad_token_id: int = 0,
    name: str = "dataset",
) -> dict[str, np.ndarray]:
    """`reference_chosen_logps` and `reference_rejected_logps` of every row of `dataset`
    (the columns DPOTrainer reads instead of running a reference model); `name`: the
    dataset's in errors."""
    from jaxtrain.data.row_checks import check_all_rows
    from jaxtrain.data.sources import as_source

    source = as_source(dataset, name=name)
    featurizer = PairFeaturizer(
        name=name, tokenizer=tokenizer, max_length=max_length, chat_template=chat_template
    )
    featurizer.detect(source.read([0])[0], source.columns)
    check_all_rows(source, featurizer)  # every row, before the reference's pass compiles
    collate = PairCollator(max_length, pad_token_id)
    graphdef, state = nnx.split(reference)

    @jax.jit
    def logps(state, batch):
        chosen, rejected, _, _ = pair_logps(nnx.merge(graphdef, state), batch)
        return chosen, rejected

    n = len(source)
    out = {c: np.zeros(n, np.float32) for c in REFERENCE_COLUMNS}
    for start in range(0, n, batch_size):
        index = list(range(start, min(start + batch_size, n)))
        examples = featurizer(source.read(index), index)
        examples += [examples[0]] * (batch_size - len(examples))  # one shape, one compile
        batch = {k: v for k, v in collate(examples).items() if k not in REFERENCE_COLUMNS}
        chosen, rejected = jax.device_get(logps(state, batch))
        out[REFERENCE_COLUMNS[0]][start : start + len(index)] = chosen[: len(index)]
        out[REFERENCE_COLUMNS[1]][start : start + len(index)] = rejected[: len(index)]
    return out

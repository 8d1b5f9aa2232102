"""Knowledge distillation: a student learns from a frozen teacher's token distributions.

Per target token, with temperature T and weight alpha:
    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
           + (1 - alpha) * cross-entropy(student, label)
summed over the tokens of every micro-batch and divided by the global batch's target tokens
(token-weighted, like the base loss). The T^2 factor keeps the KL gradient's scale
independent of T (Hinton et al. 2015). The teacher (any causal LM with the student's
vocabulary) is frozen: no gradient, no optimizer state, sharded on the same mesh.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import RunSettings
from jaxtrain.task_arguments import DistillationArguments
from jaxtrain.trainers.base import TaskStart, TaskTrainer, concrete_model, task_arguments
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.sft import SFTTrainer
from jaxtrain.training.program import Objective
from jaxtrain.training.step import causal_lm_sums, model_segment_ids

__all__ = [
    "DistillationArguments",
    "DistillationTrainer",
    "distill_objective",
    "distillation_kl",
]


def distillation_kl(
    student: jax.Array, teacher: jax.Array, labels: jax.Array, temperature: float
) -> jax.Array:
    """Sum over target positions of KL(teacher_T || student_T) (logits[:, t] predicts
    labels[:, t + 1]; positions labelled -100 do not count)."""
    s = jax.nn.log_softmax(student[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    t = jax.nn.log_softmax(teacher[:, :-1].astype(jnp.float32) / temperature, axis=-1)
    kl_BxT = (jnp.exp(t) * (t - s)).sum(-1)
    return (kl_BxT * (labels[:, 1:] != -100)).sum()


class DistillationTrainer(TaskTrainer):
    """Train `model` (the student) towards `teacher_model` on SFT rows."""

    # SFT's rows: text, messages, or prompt + completion.
    create_featurizer = SFTTrainer.create_featurizer

    def __init__(
        self,
        arguments: DistillationArguments | None = None,
        model: Any = None,
        teacher_model: Any = None,
        **kwargs: Any,
    ):
        args = task_arguments(arguments, DistillationArguments, type(self).__name__)
        if teacher_model is None:
            raise ArgumentError("DistillationTrainer needs teacher_model=<a causal LM>.")
        start = TaskStart.resolve(args, kwargs)
        settings = start.settings
        model = concrete_model(model, settings.model, start.runtime)
        teacher = concrete_model(teacher_model, settings.model, start.runtime)
        vocab = [getattr(getattr(m, "config", None), "vocab_size", None) for m in (model, teacher)]
        if None not in vocab and vocab[0] != vocab[1]:
            raise ArgumentError(
                f"the teacher's vocabulary ({vocab[1]}) differs from the student's ({vocab[0]}); "
                "distillation needs the same tokenizer for both"
            )
        super().__init__(
            **start.trainer_kwargs(
                arguments=args,
                model=TaskModel(model, teacher=teacher),
                objective=distill_objective(settings),
            )
        )


def distill_objective(settings: RunSettings) -> Objective:
    """Distillation's objective on a TaskModel (the student `model`, the frozen `teacher`):
    alpha * T^2 * KL(teacher || student at temperature T) + (1 - alpha) * cross-entropy."""
    alpha, temperature = settings.task.distill_alpha, settings.task.distill_temperature

    def loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        inputs = dict(positions=batch.get("positions"), segment_ids=model_segment_ids(batch))
        student = model.model(batch["input_ids"], **inputs)
        teacher = jax.lax.stop_gradient(model.teacher(batch["input_ids"], **inputs))
        sums = causal_lm_sums(student, batch["labels"])
        kl = distillation_kl(student, teacher, batch["labels"], temperature)
        ce = sums["loss_sum"]
        return {
            **sums,
            "loss_sum": alpha * temperature**2 * kl + (1 - alpha) * ce,
            "distill/kl_sum": kl,
            "distill/ce_sum": ce,
        }

    return Objective(loss_sums=loss_sums, token_nll=False)

"""The arguments classes of the tasks (SFTArguments, DPOArguments, DistillationArguments...);
each task's definition in jaxtrain/tasks names its own. The online RL tasks' (GRPO, RLOO) are
in jaxtrain/rollout_arguments.py.

Part of the configuration: it imports nothing of the implementation, so the command line
can parse and check a task's fields (and say which task a field belongs to) before jax,
the data or the model are touched. The trainers import these classes from here.
"""

from __future__ import annotations

import dataclasses

from jaxtrain.arguments import TrainingArguments
from jaxtrain.errors import ArgumentError, first_failed_check

__all__ = [
    "CPO_LOSS_TYPES",
    "DPO_LOSS_TYPES",
    "KTO_LOSS_TYPES",
    "CPOArguments",
    "DPOArguments",
    "DistillationArguments",
    "KTOArguments",
    "ORPOArguments",
    "SFTArguments",
]

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclasses.dataclass
class SFTArguments(TrainingArguments):
    # Learn the assistant turns / completions only (prompt tokens carry label -100).
    completion_only_loss: bool = True
    # None: on when max_steps > 0 (packing needs a known run length), else off.
    packing: bool | None = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.packing is None:
            self.packing = isinstance(self.max_steps, int) and self.max_steps > 0
        super().__post_init__()


@dataclasses.dataclass
class DPOArguments(TrainingArguments):
    # Strength of the implicit KL penalty towards the reference (the "temperature" of DPO).
    beta: float = 0.1
    # "sigmoid" (DPO), "ipo" (Azar et al. 2023) or "hinge" (SLiC).
    loss_type: str = "sigmoid"
    # sigmoid only: probability that a preference label is flipped (conservative DPO).
    label_smoothing: float = 0.0
    # Compare with a uniform reference (reference log-probs 0): no reference model at all.
    reference_free: bool = False
    # Compute the reference log-probs once before training and store them in the datasets;
    # the step then runs the policy only (the reference is not kept on the devices).
    precompute_reference_logps: bool = False

    def __post_init__(self) -> None:
        # The task's own checks first: the base's end in the subsystems' (heavy imports).
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ArgumentError(
                f"DPOArguments.loss_type={self.loss_type!r} is not one of {DPO_LOSS_TYPES}."
            )
        if not self.beta > 0:
            raise ArgumentError(f"DPOArguments.beta must be > 0, got {self.beta!r}.")
        if not 0 <= self.label_smoothing < 0.5:
            raise ArgumentError(
                f"DPOArguments.label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}."
            )
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ArgumentError("DPOArguments.label_smoothing applies to loss_type='sigmoid' only.")
        super().__post_init__()


@dataclasses.dataclass
class DistillationArguments(TrainingArguments):
    # Weight of the KL term; 1 - distill_alpha weighs the hard-label cross-entropy.
    distill_alpha: float = 0.5
    # Softmax temperature of both distributions in the KL term.
    distill_temperature: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.distill_alpha <= 1:
            raise ArgumentError(
                f"DistillationArguments.distill_alpha must be in [0, 1], got {self.distill_alpha!r}."
            )
        if not self.distill_temperature > 0:
            raise ArgumentError(
                "DistillationArguments.distill_temperature must be > 0, got "
                f"{self.distill_temperature!r}."
            )
        super().__post_init__()


@dataclasses.dataclass
class KTOArguments(TrainingArguments):
    """KTO (Ethayarajh et al. 2024) on unpaired rows: `prompt`, `completion`, `label`
    (True: desirable). Preference pairs are unpaired (chosen: desirable, rejected: not)."""

    # Strength of the pull towards the reference (as DPO's beta).
    beta: float = 0.1
    # "kto", or "apo_zero_unpaired" (APO-zero, D'Oosterlinck et al. 2024: no KL estimate).
    loss_type: str = "kto"
    # Weights of the desirable and undesirable losses: with unequal counts, the paper's
    # advice is desirable_weight * n_desirable ~= undesirable_weight * n_undesirable (to 4:3).
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        first_failed_check(
            "KTOArguments",
            [
                (
                    self.loss_type in KTO_LOSS_TYPES,
                    f"loss_type={self.loss_type!r} is not one of {KTO_LOSS_TYPES}",
                ),
                (self.beta > 0, f"beta must be > 0, got {self.beta!r}"),
                (
                    self.desirable_weight > 0 and self.undesirable_weight > 0,
                    "desirable_weight and undesirable_weight must be > 0, got "
                    f"{self.desirable_weight!r} and {self.undesirable_weight!r}",
                ),
            ],
        )
        super().__post_init__()


@dataclasses.dataclass
class ORPOArguments(TrainingArguments):
    """ORPO (Hong et al. 2024): NLL of the chosen response + beta * odds-ratio loss; no
    reference model."""

    # Weight of the odds-ratio term (the paper's lambda; TRL's `beta`).
    beta: float = 0.1

    def __post_init__(self) -> None:
        first_failed_check(
            "ORPOArguments", [(self.beta > 0, f"beta must be > 0, got {self.beta!r}")]
        )
        super().__post_init__()


@dataclasses.dataclass
class CPOArguments(TrainingArguments):
    """CPO (Xu et al. 2024): DPO without a reference + cpo_alpha * NLL of the chosen response;
    `loss_type="simpo"` with `cpo_alpha=0` is SimPO (Meng et al. 2024)."""

    # Temperature of the preference loss.
    beta: float = 0.1
    # "sigmoid" (CPO), "hinge", "ipo", or "simpo" (length-normalised log-probs and a margin).
    loss_type: str = "sigmoid"
    # sigmoid and simpo: probability that a preference label is flipped.
    label_smoothing: float = 0.0
    # Weight of the behaviour-cloning term (NLL of the chosen responses); 0 for pure SimPO.
    cpo_alpha: float = 1.0
    # simpo: the target reward margin gamma (the loss is -log sigmoid(beta * h - gamma)).
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        first_failed_check(
            "CPOArguments",
            [
                (
                    self.loss_type in CPO_LOSS_TYPES,
                    f"loss_type={self.loss_type!r} is not one of {CPO_LOSS_TYPES}",
                ),
                (self.beta > 0, f"beta must be > 0, got {self.beta!r}"),
                (
                    0 <= self.label_smoothing < 0.5,
                    f"label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}",
                ),
                (
                    not self.label_smoothing or self.loss_type in ("sigmoid", "simpo"),
                    "label_smoothing applies to loss_type 'sigmoid' and 'simpo' only",
                ),
                (self.cpo_alpha >= 0, f"cpo_alpha must be >= 0, got {self.cpo_alpha!r}"),
                (self.simpo_gamma >= 0, f"simpo_gamma must be >= 0, got {self.simpo_gamma!r}"),
            ],
        )
        super().__post_init__()

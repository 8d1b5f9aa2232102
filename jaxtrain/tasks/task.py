"""What a task is: the one definition of `--task NAME` that the command line, `jaxtrain plan`,
a restored run directory and the help all read (one module per task in this package).

A definition imports no JAX: the command line checks a task's fields and data before any
device is touched. Its hooks import the task's code when called.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxtrain.arguments import TrainingArguments
from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError

__all__ = ["Task", "imported"]


def _no_frozen(settings: RunSettings) -> dict[str, bool]:
    return {}


def _no_check(config: dict[str, Any]) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of `jaxtrain train --task NAME`."""

    name: str
    arguments: type[TrainingArguments]  # its arguments class (jaxtrain.task_arguments)
    trainer: str  # its trainer class, "module:Class", imported on use
    rows: str  # the rows its data holds, as the errors and docs say them
    # The abstract global batch its train step takes, from the run's settings alone:
    # {key: jax.ShapeDtypeStruct of [A, M, ...]} (jaxtrain/tasks/batches.py).
    batch: Callable[[Any], dict[str, Any]]
    # The Objective its step minimizes (None: the causal LM loss) from the run's settings
    # (config.sections.RunSettings), as its trainer builds it.
    objective: Callable[[Any], Any] | None = None
    # The frozen models beside the trained one, each a copy of an architecture, and whether
    # the run's settings ask for it (the slot is None when not). A "reference" is a copy of the
    # starting weights; none is in a checkpoint, so sampling and export need none of them.
    frozen: Callable[[Any], dict[str, bool]] = _no_frozen
    wrapped: bool = True  # a TaskModel around the trained model (lm and sft train it bare)
    reward_head: bool = False  # a RewardModel: scores text, exports *ForSequenceClassification
    # What it needs of the resolved config's data section and flags, checked before the
    # arguments are built (ArgumentError said in flags).
    check_data: Callable[[dict[str, Any]], None] = _no_check
    # Model sections of its own in the config (distill's teacher), and the trainer's keyword
    # arguments built from them: ({section: typed model section}, tokenizer, settings,
    # build_model) -> (kwargs, what config.yaml records).
    sections: tuple[str, ...] = ()
    trainer_kwargs: Callable[..., tuple[dict[str, Any], dict[str, Any]]] | None = None
    # Why `jaxtrain eval RUN_DIR` has nothing to evaluate (None: the run's eval set).
    no_eval_set: str | None = None
    samples_on_engine: bool = False  # its updates sample on serving.Engine: plan compiles it
    choices: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # help

    @property
    def generates(self) -> bool:
        """Whether its trained model writes text (sample, serve, lm-eval): not a reward model."""
        return not self.reward_head

    def trainer_class(self) -> type:
        module_name, _, class_name = self.trainer.partition(":")
        return getattr(importlib.import_module(module_name), class_name)

    def needs_base_weights(self, settings: RunSettings) -> bool:
        """Whether a frozen part of this run is a copy of its starting weights (a reference)."""
        return bool(self.frozen(settings).get("reference"))

    def model(self, build: Callable[[], Any], settings: RunSettings, *, frozen: bool = True) -> Any:
        """The module its trainer trains, from `build()` (a fresh model each call, concrete or
        abstract): the model, or a TaskModel of the trained part (a RewardModel around it
        for reward) beside its frozen copies. `frozen=False` leaves the frozen copies out:
        the module a checkpoint's parameters restore into."""
        from jaxtrain.trainers.frozen import TaskModel

        model = build()
        if not self.wrapped:
            return model
        if self.reward_head:
            from jaxtrain.trainers.reward import RewardModel

            if not isinstance(model, RewardModel):
                model = RewardModel(model, seed=settings.model.seed)
        slots = self.frozen(settings).items()
        return TaskModel(model, **{name: build() if frozen and on else None for name, on in slots})

    def save_model(self, program: Any, state: Any, directory: str | Path, **kwargs: Any) -> Path:
        """`state`'s trained model as a Hugging Face directory of this task's kind: a causal
        LM, or for reward a `*ForSequenceClassification` (kwargs: hf.save_pretrained's, and
        `pad_token_id` for reward)."""
        from jaxtrain.hf.save import save_program_state

        if self.reward_head:
            from jaxtrain.trainers.reward import save_reward_model

            if kwargs.pop("lora_format", "merged") != "merged":
                raise ArgumentError(
                    "a reward model is exported as a sequence-classification directory with its "
                    "adapters merged; drop lora_format."
                )

            return save_reward_model(program.model_from_state(state), directory, **kwargs)
        kwargs.pop("pad_token_id", None)  # the LM's config already holds it
        return save_program_state(program, state, directory, **kwargs)


def imported(path: str) -> Callable[..., Any]:
    """The function at "module:name", imported when first called (a definition's hooks
    import the task's JAX code only when used)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        module_name, _, name = path.partition(":")
        return getattr(importlib.import_module(module_name), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = path
    return call

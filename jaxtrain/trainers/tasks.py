"""The tasks of `jaxtrain train --task TASK`: each one's trainer, the rows it reads, and the
model it trains (the trained part and its frozen parts), which `plan` compiles and a run
directory restores without building the task's trainer or reading its data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxtrain.arguments import TrainingArguments
from jaxtrain.task_arguments import task_arguments_class

__all__ = ["TASKS", "Task", "save_task_model", "task_classes", "task_model"]


def _no_frozen(args: Any) -> dict[str, bool]:
    return {}


@dataclasses.dataclass(frozen=True)
class Task:
    """One task, as the CLI, `plan` and a restored run read it."""

    trainer: str  # the trainer class's import path
    rows: str  # the rows its data holds
    # The frozen models beside the trained one, each a copy of its architecture, and whether
    # the arguments ask for it (the slot is None when not): never in a checkpoint, so
    # sampling and export need none of them.
    frozen: Callable[[Any], dict[str, bool]] = _no_frozen
    wrapped: bool = True  # a TaskModel around the trained model (lm and sft train it bare)
    reward_head: bool = False  # a RewardModel: scores text, exports *ForSequenceClassification
    # Why `jaxtrain eval RUN_DIR` has nothing to evaluate (None: the run's eval set).
    no_eval_set: str | None = None


def _dpo_frozen(args: Any) -> dict[str, bool]:
    # With LoRA the reference is the policy's base without adapters: no second copy.
    return {"reference": not (args.reference_free or args.lora_rank)}


def _grpo_frozen(args: Any) -> dict[str, bool]:
    return {"reference": args.beta > 0 and not args.lora_rank}


_PAIRS = "prompt, chosen, rejected"
_SFT_ROWS = "text, messages or prompt+completion"

TASKS: dict[str, Task] = {
    "lm": Task("jaxtrain.training.trainer.Trainer", "text or input_ids", wrapped=False),
    "sft": Task("jaxtrain.trainers.sft.SFTTrainer", _SFT_ROWS, wrapped=False),
    "dpo": Task("jaxtrain.trainers.dpo.DPOTrainer", _PAIRS, _dpo_frozen),
    "reward": Task("jaxtrain.trainers.reward.RewardTrainer", _PAIRS, reward_head=True),
    "distill": Task(
        "jaxtrain.trainers.distill.DistillationTrainer", _SFT_ROWS, lambda args: {"teacher": True}
    ),
    "grpo": Task(
        "jaxtrain.trainers.grpo.GRPOTrainer",
        "prompt, messages or prompt_ids (+ columns for the rewards)",
        _grpo_frozen,
        no_eval_set=(
            "a GRPO run has no eval set to evaluate: --task grpo trains without "
            "data.eval_files (its reward functions score sampled completions). Score it with "
            "`jaxtrain evaluate RUN_DIR --tasks ...`, or read `jaxtrain sample RUN_DIR`."
        ),
    ),
    "kto": Task(
        "jaxtrain.trainers.kto.KTOTrainer",
        "prompt, completion, label (or prompt, chosen, rejected)",
        lambda args: {"reference": True},
    ),
    "orpo": Task("jaxtrain.trainers.orpo.ORPOTrainer", _PAIRS),
    "cpo": Task("jaxtrain.trainers.cpo.CPOTrainer", _PAIRS),
}


def task_classes(task: str) -> tuple[type[TrainingArguments], Any]:
    """(arguments class, trainer class) of `task`; ArgumentError naming the known tasks."""
    import importlib

    arguments_cls = task_arguments_class(task)  # ArgumentError naming the tasks
    module_name, _, class_name = TASKS[task].trainer.rpartition(".")
    trainer_cls = getattr(importlib.import_module(module_name), class_name)
    return arguments_cls, trainer_cls


def task_model(task: str, build: Callable[[], Any], args: Any, *, frozen: bool = True) -> Any:
    """The module `task`'s trainer trains, from `build()` (a fresh model each call, a
    concrete or an abstract one): the model, or a TaskModel of the trained part (a
    RewardModel around it for reward) beside its frozen copies. `frozen=False` leaves the
    frozen copies out: the module a checkpoint's parameters restore into."""
    from jaxtrain.trainers.frozen import TaskModel

    definition = TASKS[task]
    model = build()
    if not definition.wrapped:
        return model
    if definition.reward_head:
        from jaxtrain.trainers.reward import RewardModel

        if not isinstance(model, RewardModel):
            model = RewardModel(model, seed=args.seed)
    slots = definition.frozen(args).items()
    return TaskModel(model, **{name: build() if frozen and on else None for name, on in slots})


def save_task_model(
    task: str, program: Any, state: Any, directory: str | Path, **kwargs: Any
) -> Path:
    """`state`'s trained model as a Hugging Face directory of the task's kind: a causal LM,
    or for reward a `*ForSequenceClassification` (kwargs: hf.save_pretrained's, and
    `pad_token_id` for reward)."""
    from jaxtrain.hf.save import save_program_state

    if TASKS[task].reward_head:
        from jaxtrain.trainers.reward import save_reward_model

        return save_reward_model(program.model_from_state(state), directory, **kwargs)
    kwargs.pop("pad_token_id", None)  # the LM's config already holds it
    return save_program_state(program, state, directory, **kwargs)

"""The model's fields of TrainingArguments (remat policy, LoRA), checked by the models that
define their values (run from TrainingArguments' validation). Models sit below the
configuration, so this module takes the arguments duck-typed and imports only errors."""

from __future__ import annotations

import difflib
from typing import Any

from jaxtrain.errors import ArgumentError
from jaxtrain.models.llama import REMAT_POLICIES
from jaxtrain.models.lora import resolve_targets


def check_arguments(args: Any) -> None:
    policy = args.gradient_checkpointing
    if policy not in REMAT_POLICIES:
        close = difflib.get_close_matches(str(policy), REMAT_POLICIES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ArgumentError(
            f"TrainingArguments.gradient_checkpointing={policy!r} is not supported.{hint} "
            f"Choose one of: {', '.join(REMAT_POLICIES)}."
        )
    check_lora_arguments(args)


def check_lora_arguments(args: Any) -> None:
    rank, alpha = args.lora_rank, args.lora_alpha
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ArgumentError(f"TrainingArguments.lora_rank must be an int, got {rank!r}.")
    if rank < 0:
        raise ArgumentError(f"TrainingArguments.lora_rank must be >= 0, got {rank}.")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ArgumentError(f"TrainingArguments.lora_alpha must be a number, got {alpha!r}.")
    if not alpha > 0:
        raise ArgumentError(f"TrainingArguments.lora_alpha must be > 0, got {alpha}.")
    if not 0 <= args.lora_dropout < 1:
        raise ArgumentError(
            f"TrainingArguments.lora_dropout must be in [0, 1), got {args.lora_dropout!r}."
        )
    if isinstance(args.lora_targets, str):  # CLI: --lora_targets attention,mlp
        args.lora_targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    try:
        resolve_targets(list(args.lora_targets or []))
    except ValueError as err:
        raise ArgumentError(f"TrainingArguments.{err}") from None

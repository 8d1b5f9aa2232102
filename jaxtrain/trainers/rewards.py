"""Reward functions of GRPO: calling them with checks, two built-ins, loading by path.

A reward function is `fn(prompts, completions, **columns) -> list[float | None]`: one value
per completion (None: this function does not score it); `columns` are the dataset's other
columns, row-aligned with the completions. Everything here runs on the host.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxtrain.errors import ArgumentError, RewardError

__all__ = [
    "RewardError",
    "format_regex",
    "last_number_matches",
    "load_reward",
    "reward_model",
    "reward_name",
    "score_completions",
]

RewardFunc = Callable[..., Sequence[float | None]]


def reward_model(model: Any, tokenizer: Any = None, **kwargs: Any) -> RewardFunc:
    """A RewardModel (or a RewardTrainer export directory) as a reward function; see
    jaxtrain.trainers.reward_scoring.reward_model."""
    # Imported here: the scorer loads JAX models, the rest of this module is host-only.
    from jaxtrain.trainers.reward_scoring import reward_model as build

    return build(model, tokenizer, **kwargs)


def reward_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(
    prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 when the last number in the completion equals the `answer` column, else 0.0."""
    out = []
    for text, want in zip(completions, answer):
        found = _NUMBER.findall(text)
        try:
            out.append(float(bool(found) and float(found[-1]) == float(want)))
        except (TypeError, ValueError):
            out.append(0.0)
    return out


def format_regex(pattern: str) -> RewardFunc:
    """A reward of 1.0 for completions that `pattern` matches in full (re.DOTALL), else 0."""
    compiled = re.compile(pattern, re.DOTALL)

    def format_reward(prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float]:
        return [float(compiled.fullmatch(text.strip()) is not None) for text in completions]

    format_reward.__name__ = f"format_regex({pattern!r})"
    return format_reward


BUILTINS = ("last_number_matches", "format_regex")


def import_from_here(module_name: str) -> Any:
    """Import `module_name`, finding it in the current directory too: the `jaxtrain` console
    script (unlike `python -m`) does not put it on sys.path, and a reward module beside the
    data is the common case."""
    here = os.getcwd()
    if here in sys.path or "" in sys.path:
        return importlib.import_module(module_name)
    sys.path.append(here)  # after everything installed: a local file never shadows a package
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(here)


def load_reward(spec: str, *, format_pattern: str | None = None) -> RewardFunc:
    """A reward function from `module:function` (or `module.function`), or a built-in name."""
    if spec == "last_number_matches":
        return last_number_matches
    if spec == "format_regex":
        if not format_pattern:
            raise ArgumentError(
                "the format_regex reward needs a pattern: set format_pattern (--format_pattern)."
            )
        return format_regex(format_pattern)
    return load_callable(spec, "reward", f"nor a built-in ({', '.join(BUILTINS)})")


FLOAT32_MAX = float(np.finfo(np.float32).max)


def load_callable(spec: str, what: str, alternatives: str = "") -> Callable:
    """A function or class from `module:name` (or `module.name`): a reward, a tool or an
    environment named on the command line."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ArgumentError(
            f"{what} {spec!r} is not module:name (e.g. my_module:my_{what}) {alternatives}".strip()
        )
    try:
        found = getattr(import_from_here(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ArgumentError(f"{what} {spec!r} cannot be loaded: {exc}") from exc
    except SyntaxError as exc:
        raise ArgumentError(
            f"{what} {spec!r} cannot be loaded: {exc.filename} line {exc.lineno}: {exc.msg}"
        ) from exc
    except Exception as exc:  # the module's own code failed as it was imported
        raise ArgumentError(
            f"{what} {spec!r} cannot be loaded: importing {module_name} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not callable(found):
        raise ArgumentError(f"{what} {spec!r} is not callable.")
    return found


def _call(fn: RewardFunc, prompts: list[Any], completions: list[str], columns: dict) -> Any:
    try:
        return fn(prompts=prompts, completions=completions, **columns)
    except Exception as exc:
        # Find the first prompt the function fails on, so the error can name it.
        for i in range(len(prompts)):
            row = {k: v[i : i + 1] for k, v in columns.items()}
            try:
                fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **row)
            except Exception:
                raise RewardError(
                    f"reward function {reward_name(fn)} raised {type(exc).__name__}: {exc} on "
                    f"prompt {prompts[i]!r} (completion {completions[i]!r})"
                ) from exc
        raise RewardError(
            f"reward function {reward_name(fn)} raised {type(exc).__name__}: {exc} on the batch "
            f"whose first prompt is {prompts[0]!r}"
        ) from exc


def score_completions(
    funcs: Sequence[RewardFunc],
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
) -> np.ndarray:
    """Rewards [N, F] (NaN where a function returned None), checked: a function that raises,
    returns the wrong number of values, a NaN or a non-number, or a batch that no function
    scored at all, is a RewardError naming the function (before any update)."""
    n = len(completions)
    out = np.full((n, len(funcs)), np.nan, np.float64)
    for j, fn in enumerate(funcs):
        values = _call(fn, prompts, completions, columns)
        name = reward_name(fn)
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"reward function {name} returned {type(values).__name__}; return a list of "
                f"{n} floats (None: not scored), one per completion"
            ) from None
        if len(values) != n:
            raise RewardError(
                f"reward function {name} returned {len(values)} values for {n} completions; "
                "return one value (float or None) per completion"
            )
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                if isinstance(v, str | bytes):  # float("1.0") would read it: a bug upstream
                    raise TypeError
                x = float(v)
            except (TypeError, ValueError):
                raise RewardError(
                    f"reward function {name} returned {v!r} for prompt {prompts[i]!r}; "
                    "rewards are floats (or None: not scored)"
                ) from None
            if math.isnan(x):
                raise RewardError(
                    f"reward function {name} returned NaN for prompt {prompts[i]!r}; return "
                    "None for a completion it does not score"
                )
            if not abs(x) <= FLOAT32_MAX:  # the loss computes in float32: inf there
                raise RewardError(
                    f"reward function {name} returned {x!r} for prompt {prompts[i]!r}; "
                    "rewards must be finite numbers within float32's range"
                )
            out[i, j] = x
    if np.isnan(out).all():
        names = ", ".join(reward_name(f) for f in funcs)
        raise RewardError(
            f"the reward functions ({names}) returned None for every completion of the batch: "
            "nothing to learn from; check their inputs (columns: "
            f"{sorted(columns) or 'none'})"
        )
    return out

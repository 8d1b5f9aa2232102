"""The engine's settings, checked before it allocates anything: a bad one is one line that
names it."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from jaxtrain.errors import ArgumentError
from jaxtrain.models.gpt2 import GPT2LMHeadModel
from jaxtrain.models.kv_cache import supports_kv_cache

__all__ = ["check_engine_options", "check_max_length", "check_request"]


def check_engine_options(
    model: Any,
    *,
    max_slots: Any,
    page_size: Any,
    prefill_tokens: Any,
    speculative_tokens: Any,
    attention: Any,
    decode_steps: Any = 1,
    logprobs_mode: Any,
    record_routing: bool = False,
) -> None:
    """Raises ArgumentError for a setting Engine cannot take (see Engine's docstring)."""
    if record_routing and not hasattr(model.config, "num_experts_per_tok"):
        raise ArgumentError(
            f"record_routing keeps a mixture-of-experts model's expert choices; "
            f"{type(model).__name__} has no experts: leave it off."
        )
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise ArgumentError(
            f"speculative_tokens must be an integer >= 0 (0: off), got {speculative_tokens!r}"
        )
    if not isinstance(decode_steps, int) or decode_steps < 1:
        raise ArgumentError(f"decode_steps must be an integer >= 1, got {decode_steps!r}")
    if decode_steps > 1 and speculative_tokens:
        raise ArgumentError(
            f"decode_steps={decode_steps} and speculative_tokens={speculative_tokens}: each "
            "decode call takes several tokens either way; choose one (the other at its "
            "default)"
        )
    if attention not in ("auto", "gather", "pallas", "interpret"):
        raise ArgumentError(
            f"attention must be auto, gather, pallas or interpret, got {attention!r}"
        )
    if logprobs_mode not in ("raw", "processed"):
        raise ArgumentError(f"logprobs_mode must be raw or processed, got {logprobs_mode!r}")
    if not supports_kv_cache(model):
        raise ArgumentError(
            f"the engine decodes with a KV cache; {type(model).__name__} has none (the "
            "Llama family and its dropless MoE, Gemma 2 / 3 and GPT-2 have)."
        )
    for name, value in (("max_slots", max_slots), ("page_size", page_size),
                        ("prefill_tokens", prefill_tokens)):  # fmt: skip
        if not isinstance(value, int) or value < 1:
            raise ArgumentError(f"{name} must be a positive integer, got {value!r}")


def check_max_length(model: Any, max_length: Any) -> int:
    """The engine's max_length, checked: a model of learned positions (GPT-2) has none past
    its table (a lookup there would clamp, and decode garbage in silence)."""
    if not isinstance(max_length, numbers.Integral) or isinstance(max_length, bool):
        raise ArgumentError(f"max_length must be an integer >= 2, got {max_length!r}")
    max_length = int(max_length)
    if max_length < 2:
        raise ArgumentError(f"max_length must be an integer >= 2, got {max_length!r}")
    table = int(model.config.max_position_embeddings)
    if isinstance(model, GPT2LMHeadModel) and max_length > table:
        raise ArgumentError(
            f"max_length={max_length} is past this GPT-2's {table} learned positions "
            f"(max_position_embeddings): give the engine max_length <= {table}."
        )
    return max_length


def check_request(
    prompt_ids: Any,
    params: Any,
    n: int,
    *,
    vocab_size: int,
    max_length: int,
    max_slots: int,
    page_size: int,
    pages: int,
) -> np.ndarray:
    """The prompt's ids [T] (int32), or ArgumentError for a request an engine of these sizes
    cannot run (`pages`: its pool's, the garbage page left out)."""
    if isinstance(prompt_ids, str | bytes):
        raise ArgumentError(
            "a prompt is a sequence of token ids, not text: tokenize it first "
            "(tokenizer(text)['input_ids'])"
        )
    prompt = np.asarray(list(prompt_ids))
    if prompt.ndim != 1 or not len(prompt):
        raise ArgumentError("a request needs a non-empty prompt of token ids")
    if not np.issubdtype(prompt.dtype, np.integer):  # 1.5 would be read as token 1
        raise ArgumentError(f"prompt token ids must be integers, got {prompt[0].item()!r} ...")
    if prompt.min() < 0 or prompt.max() >= vocab_size:  # its pages would hold NaN for good
        bad = int(prompt[(prompt < 0) | (prompt >= vocab_size)][0])
        raise ArgumentError(f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})")
    outside = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise ArgumentError(
            f"stop_token_ids {outside} are outside the vocabulary (0 to {vocab_size - 1})"
        )
    if len(prompt) + params.max_tokens > max_length:
        raise ArgumentError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"engine's max_length {max_length}; shorten the prompt or lower max_tokens"
        )
    if not 1 <= n <= max_slots:
        raise ArgumentError(f"n={n}: a request takes 1 to max_slots={max_slots} samples")
    need = math.ceil((len(prompt) + params.max_tokens) / page_size)
    if need > pages:
        raise ArgumentError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs {need} "
            f"pages of {page_size} tokens; the KV cache has {pages}: "
            "lower max_tokens, or give the engine more (num_pages, kv_cache_gib)"
        )
    return prompt.astype(np.int32)

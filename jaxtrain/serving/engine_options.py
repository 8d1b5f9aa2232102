"""The engine's settings, checked before it allocates anything: a bad one is one line that
names it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxtrain.errors import ArgumentError
from jaxtrain.models.kv_cache import supports_kv_cache

__all__ = ["check_engine_options", "check_request"]


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


def check_request(
    prompt: np.ndarray,
    params: Any,
    n: int,
    *,
    vocab_size: int,
    max_length: int,
    max_slots: int,
    page_size: int,
    pages: int,
) -> None:
    """ArgumentError for a request an engine of these sizes cannot run (`pages`: its pool's,
    the garbage page left out)."""
    if prompt.ndim != 1 or not len(prompt):
        raise ArgumentError("a request needs a non-empty prompt of token ids")
    if prompt.min() < 0 or prompt.max() >= vocab_size:  # its pages would hold NaN for good
        bad = int(prompt[(prompt < 0) | (prompt >= vocab_size)][0])
        raise ArgumentError(f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})")
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

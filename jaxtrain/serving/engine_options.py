"""The engine's settings, checked before it allocates anything: a bad one is one line that
names it."""

from __future__ import annotations

from typing import Any

from jaxtrain.errors import ArgumentError
from jaxtrain.models.kv_cache import supports_kv_cache

__all__ = ["check_engine_options"]


def check_engine_options(
    model: Any,
    *,
    max_slots: Any,
    page_size: Any,
    prefill_tokens: Any,
    speculative_tokens: Any,
    attention: Any,
    logprobs_mode: Any,
) -> None:
    """Raises ArgumentError for a setting Engine cannot take (see Engine's docstring)."""
    if not isinstance(speculative_tokens, int) or speculative_tokens < 0:
        raise ArgumentError(
            f"speculative_tokens must be an integer >= 0 (0: off), got {speculative_tokens!r}"
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

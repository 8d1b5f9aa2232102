"""Which token id fills the padding positions of a batch.

Padding positions are never targets (their labels are ignored), but the id still enters the
model, so it must be a real token of the vocabulary: the tokenizer's pad token, else its end
of sequence token (the usual choice for Llama-style tokenizers that ship no pad token).
"""

from __future__ import annotations

import logging
from typing import Any

from jaxtrain.errors import ArgumentError

logger = logging.getLogger("jaxtrain.data")


def _first_id(value: Any) -> int | None:
    if isinstance(value, list | tuple):  # e.g. LlamaConfig.eos_token_id = [128001, 128009]
        value = value[0] if value else None
    return None if value is None else int(value)


SPECIAL_TOKENS = ("pad_token_id", "eos_token_id", "bos_token_id")


def _all_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def check_special_token_ids(tokenizer: Any, model_config: Any, vocab_size: int | None) -> None:
    """Every pad/eos/bos id of the tokenizer and the model config must index the model's
    embedding table: an id outside [0, vocab_size) embeds as NaN (JAX fills out-of-range
    gathers) and the run dies at step 1, long after the cause. ArgumentError otherwise."""
    if vocab_size is None:
        return
    for source, where in ((tokenizer, "tokenizer"), (model_config, "model config")):
        for field in SPECIAL_TOKENS:
            for token_id in _all_ids(getattr(source, field, None)):
                if not 0 <= token_id < vocab_size:
                    raise ArgumentError(
                        f"The {where}'s {field}={token_id} lies outside the model's vocabulary "
                        f"(vocab_size={vocab_size}: ids 0..{vocab_size - 1}), so it cannot be "
                        f"embedded. Set {where} {field} to an id below {vocab_size} (e.g. "
                        "tokenizer.pad_token = tokenizer.eos_token, or the config's real special "
                        "ids), or give the model a vocab_size that covers it."
                    )


def resolve_pad_token_id(tokenizer: Any, model_config: Any, vocab_size: int | None = None) -> int:
    """pad of the tokenizer or model config; else their eos (with a warning).

    A tokenizer with neither pad nor eos token is an ArgumentError: there is no id that is
    safe to pad with. Without a tokenizer the data is already token ids; padding with 0 then
    stays the documented fallback when the model config names no pad or eos token either.
    Every special id is first checked against `vocab_size` (default: the model config's),
    see `check_special_token_ids`.
    """
    if vocab_size is None:
        vocab_size = getattr(model_config, "vocab_size", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor's own
    check_special_token_ids(tokenizer, model_config, vocab_size)
    for source in (tokenizer, model_config):
        pad = _first_id(getattr(source, "pad_token_id", None))
        if pad is not None:
            return pad
    for source in (tokenizer, model_config):
        eos = _first_id(getattr(source, "eos_token_id", None))
        if eos is not None:
            logger.warning(
                "The %s has no pad token: padding with its eos token id %d (padding positions "
                "are never targets). Set tokenizer.pad_token to choose another.",
                "tokenizer" if source is tokenizer else "model config",
                eos,
            )
            return eos
    if tokenizer is not None:
        raise ArgumentError(
            f"The tokenizer ({type(tokenizer).__name__}) has neither a pad token nor an eos "
            "token, so batches cannot be padded. Set tokenizer.pad_token (e.g. "
            "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and a matching vocab_size)."
        )
    return 0

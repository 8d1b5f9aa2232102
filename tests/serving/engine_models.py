"""What the engine's tests share: a tiny random Llama, random prompts, and JAX's compile log
read on every thread (the engine of a server steps on a thread of its own)."""

from __future__ import annotations

import logging
import re
from collections import Counter

import jax
import numpy as np
from flax import nnx

from jaxtrain.models import LlamaConfig, LlamaForCausalLM

VOCAB = 61


def tiny_llama(
    max_positions: int = 64, initializer_range: float = 0.3, seed: int = 0
) -> LlamaForCausalLM:
    """2 layers, hidden 32, grouped-query attention. The default initializer gives peaked
    distributions (greedy tokens are not near-ties); 0.1 gives a model that falls into loops."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=initializer_range,
    )  # fmt: skip
    return LlamaForCausalLM(config, rngs=nnx.Rngs(seed))


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


class CompileLog(logging.Handler):
    """The names JAX's compile log reports, on any thread, while it is installed (the log is
    switched on with jax.config: `with jax.log_compiles()` holds for its own thread only)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.compiled: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Compiling (?:jit\()?([\w.<>]+)", record.getMessage())
        if found:
            self.compiled[found.group(1)] += 1

    def __enter__(self) -> CompileLog:
        self.was = jax.config.jax_log_compiles
        jax.config.update("jax_log_compiles", True)
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("jax").removeHandler(self)
        jax.config.update("jax_log_compiles", self.was)

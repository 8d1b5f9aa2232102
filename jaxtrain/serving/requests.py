"""What the engine keeps of a request: the request as queued, a prompt being prefilled (its
pages held, its chunks written one step at a time), each sample as it decodes, and the
finished completion handed back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from jaxtrain.serving.sampling import SamplingParams

__all__ = ["Completion", "OnToken", "eos_ids", "sample_seed"]

# on_token(request_id, index, token, logprob, top): every new token of sample `index`, with its
# log-prob and, when the request asked for `logprobs` = k > 0, {token id: log-prob} of the k
# most likely tokens at its position (else None).
OnToken = Callable[[int, int, int, float, "dict[int, float] | None"], None]


@dataclasses.dataclass
class Completion:
    """One finished sample of a request. `logprobs`: each generated token's log-prob under
    the model (log_softmax of its logits, before temperature and filters; after the
    temperature on an engine of logprobs_mode="processed"); `top_logprobs`:
    with SamplingParams.logprobs = k > 0, the k most likely tokens' at each position."""

    request_id: int
    index: int  # which of the request's n samples
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (eos, stop id or string) or "length" (max_tokens)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    # An engine with record_routing (a MoE model): [S sparse layers, tokens, k] experts of
    # every token that went through the model (the prompt, then all generated but the last).
    routing: np.ndarray | None = None


# Requests, prefills and sequences compare by identity (eq=False): the engine finds and removes
# one object in its lists, and comparing every field at each lookup was a fifth of a decode
# step's host time with 32 sequences.
@dataclasses.dataclass(eq=False)
class Request:
    """A request waiting for its slots: `prompt` is what its prefill writes. A preempted
    sample comes back as a request of its own (n = 1, `resume` the sample): its prompt is
    the sample's prompt and every token it had generated, recomputed on re-admission."""

    request_id: int
    prompt: np.ndarray
    params: SamplingParams
    n: int
    on_token: OnToken | None
    resume: Sequence | None = None
    images: np.ndarray | None = None  # the prompt's images' pixels (serving/images.py)
    adapter: int = 0  # the LoRA adapter it runs through (serving/adapters.py; 0: none)


@dataclasses.dataclass(eq=False)
class Prefill:
    """A request admitted and being prefilled: every sample's page table is held (the first
    holds the prompt; the others share its full pages), `done` prompt tokens are in the cache
    (a cached prefix, then each chunk written)."""

    request: Request
    tables: list[list[int]]
    done: int

    @property
    def remaining(self) -> int:
        return len(self.request.prompt) - self.done


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample decoding."""

    request_id: int
    index: int
    prompt: np.ndarray
    params: SamplingParams
    pages: list[int]
    on_token: OnToken | None
    images: np.ndarray | None = None  # the prompt's images' pixels (serving/images.py)
    adapter: int = 0  # the LoRA adapter it runs through (serving/adapters.py; 0: none)
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    text: str | None = None

    @property
    def position(self) -> int:
        """Position of the newest token (the next decode step's input)."""
        return len(self.prompt) + len(self.generated) - 1

    @property
    def tokens(self) -> np.ndarray:
        """The prompt then the tokens generated so far."""
        return np.concatenate([self.prompt, np.asarray(self.generated, np.int32)])

    def preempted(self) -> Request:
        """The request that recomputes this sample's cache and goes on decoding it."""
        return Request(
            self.request_id, self.tokens, self.params, 1, self.on_token, resume=self,
            images=self.images, adapter=self.adapter,
        )  # fmt: skip

    def completion(
        self, text: str | None, reason: str, routing: np.ndarray | None = None
    ) -> Completion:
        return Completion(
            self.request_id,
            self.index,
            self.prompt.tolist(),
            self.generated,
            text,
            reason,
            self.logprobs,
            self.top_logprobs if self.params.logprobs else None,
            routing,
        )


def sample_seed(seed: int, index: int) -> int:
    """The draw seed of sample `index` of a request seeded `seed` (distinct per sample).
    Any integer is a seed (OpenAI's are 64-bit, negative too): its high bits are mixed into
    the low 32, which seeds below 2**32 keep as they are (2**40 was seed 0)."""
    wide = int(seed) % 2**64
    low = (wide ^ (wide >> 32) * 0x9E3779B1) % 2**32
    return (low * 1_000_003 + index) % 2**32


def eos_ids(given: Iterable[int] | None, tokenizer: Any, config: Any) -> list[int]:
    """The end-of-sequence ids: those given, else the tokenizer's, else the config's."""
    if given is not None:
        return [int(e) for e in given]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    return [int(e) for e in eos if e is not None]

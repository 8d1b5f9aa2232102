"""The generation engine: requests in a queue, a scheduler admitting them into free slots,
a paged KV cache, compiled prefill and decode steps (serving/steps.py).

    engine = Engine(model, tokenizer=tokenizer, max_slots=8)
    [completion] = engine.generate([prompt_ids], SamplingParams(max_tokens=32))[0]

Each `step()` admits waiting requests while slots and pages allow (a request's n samples are
admitted together: the prompt is prefilled once, its full pages shared by every sample and
its last, partial page copied), then runs one decode step for every active sequence, in the
smallest bucket of rows that holds them, reading the smallest bucket of pages that holds the
longest of them (not the whole max_length). A sequence that ends (an end-of-sequence id, a stop
string, max_tokens) frees its slot and its pages at once; the next waiting request takes
them in the same step. A prompt's full pages stay cached (evicted when pages run short), so a
later request with the same prefix (a shared system prompt) prefills only the rest.

The model's state is an argument of every compiled step: `update_state(state)` swaps in live
parameters (GRPO's policy after each update) without a recompile.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.models.kv_cache import supports_kv_cache
from jaxtrain.serving.paged import PageAllocator, empty_pool, prefix_keys
from jaxtrain.serving.sampling import Draw, SamplingParams
from jaxtrain.serving.steps import Steps, bucket

__all__ = ["Completion", "Engine"]

SMALLEST_PREFILL = 16
# Pages: the narrowest page table a step reads. A step's table is as wide as the longest of
# its sequences needs (a power-of-two bucket of this), so attention reads the pages in use,
# not max_length's: a short chat on a model with an 8k context reads 8 pages, not 512.
SMALLEST_TABLE = 8


@dataclasses.dataclass
class Completion:
    """One finished sample of a request."""

    request_id: int
    index: int  # which of the request's n samples
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (eos, stop id or string) or "length" (max_tokens)


@dataclasses.dataclass
class _Sequence:
    request_id: int
    index: int
    prompt: np.ndarray
    params: SamplingParams
    pages: list[int]
    on_token: Callable[[int, int, int], None] | None
    generated: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None

    @property
    def position(self) -> int:
        """Position of the newest token (the next decode step's input)."""
        return len(self.prompt) + len(self.generated) - 1


@dataclasses.dataclass
class _Request:
    request_id: int
    prompt: np.ndarray
    params: SamplingParams
    n: int
    on_token: Callable[[int, int, int], None] | None


class Engine:
    """See the module docstring. `model`: an NNX model of a family with a KV cache (the
    Llama family and its dropless MoE, Gemma 2 / 3, GPT-2); `max_slots`: sequences decoded
    at once; `page_size`: tokens per page; `max_length`: prompt + new tokens of one
    sequence (default the model's context); `num_pages`: the pool (default enough for every
    slot at max_length); `eos_token_ids`: default the tokenizer's or the config's."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        tokenizer: Any = None,
        max_slots: int = 8,
        page_size: int = 16,
        max_length: int | None = None,
        num_pages: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ):
        if not supports_kv_cache(model):
            raise ArgumentError(
                f"the engine decodes with a KV cache; {type(model).__name__} has none (the "
                "Llama family and its dropless MoE, Gemma 2 / 3 and GPT-2 have)."
            )
        config = model.config
        self.tokenizer, self.max_slots, self.page_size = tokenizer, max_slots, page_size
        self.max_length = max_length or int(config.max_position_embeddings)
        self.max_pages = math.ceil(self.max_length / page_size)
        num_pages = num_pages or max_slots * self.max_pages + 1
        self.graphdef, self.state = nnx.split(model)
        sharding = pool_sharding(self.state)
        self.pool = jax.device_put(empty_pool(model, num_pages, page_size), sharding)
        self.pages = PageAllocator(num_pages, page_size)
        self.steps = Steps(self.graphdef, page_size, sharding)
        self.eos = set(_eos_ids(eos_token_ids, tokenizer, config))
        self.waiting: collections.deque[_Request] = collections.deque()
        self.active: list[_Sequence] = []
        self.finished: list[Completion] = []
        self._ids = itertools.count()

    # ------------------------------------------------------------ requests
    def update_state(self, state: Any) -> None:
        """Decode from these parameters from now on (the same structure: no recompile)."""
        self.state = state

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        n: int = 1,
        on_token: Callable[[int, int, int], None] | None = None,
    ) -> int:
        """Queue a request of `n` samples; returns its id. `on_token(request_id, index,
        token)` is called for every new token (streaming)."""
        params = params or SamplingParams()
        prompt = np.asarray(list(prompt_ids), np.int32)
        if prompt.ndim != 1 or not len(prompt):
            raise ArgumentError("a request needs a non-empty prompt of token ids")
        if len(prompt) + params.max_tokens > self.max_length:
            raise ArgumentError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"engine's max_length {self.max_length}; shorten the prompt or lower max_tokens"
            )
        if not 1 <= n <= self.max_slots:
            raise ArgumentError(f"n={n}: a request takes 1 to max_slots={self.max_slots} samples")
        request_id = next(self._ids)
        self.waiting.append(_Request(request_id, prompt, params, n, on_token))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Drop a request: waiting, or decoding (its slots and pages are freed now)."""
        self.waiting = collections.deque(r for r in self.waiting if r.request_id != request_id)
        for seq in [s for s in self.active if s.request_id == request_id]:
            self.active.remove(seq)
            self.pages.release(seq.pages)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None, n: int = 1
    ) -> list[list[Completion]]:
        """Every prompt's n completions, in order (runs the engine until they are done)."""
        ids = [self.submit(p, params, n=n) for p in prompts]
        done: dict[int, list[Completion]] = {i: [] for i in ids}
        while any(len(done[i]) < n for i in ids):
            for completion in self.step():
                if completion.request_id in done:
                    done[completion.request_id].append(completion)
        return [sorted(done[i], key=lambda c: c.index) for i in ids]

    # ------------------------------------------------------------ the loop
    def step(self) -> list[Completion]:
        """Admit what fits, decode one token for every active sequence; returns the
        sequences that finished in this step."""
        self.finished = []
        while self.waiting and self._admit(self.waiting[0]):
            self.waiting.popleft()
        if not self.active and self.waiting:
            request = self.waiting[0]
            raise ArgumentError(
                f"request {request.request_id} ({len(request.prompt)} prompt tokens, "
                f"max_tokens {request.params.max_tokens}, n={request.n}) does not fit the KV "
                f"cache even alone ({self.pages.available} free pages of {self.page_size}); "
                "raise num_pages"
            )
        if self.active:
            self._decode()
        return self.finished

    def _pages_for(self, seq_len: int, params: SamplingParams) -> int:
        return math.ceil((seq_len + params.max_tokens) / self.page_size)

    def _admit(self, request: _Request) -> bool:
        """Prefill `request` and start its samples, if slots and pages allow."""
        if len(self.active) + request.n > self.max_slots:
            return False
        prompt, size, params = request.prompt, self.page_size, request.params
        total = self._pages_for(len(prompt), params)
        cached = self.pages.cached_prefix(prefix_keys(prompt[: len(prompt) - 1], size))
        full = len(prompt) // size  # pages the prompt fills: shared by the other samples
        partial = len(prompt) % size != 0
        need = (total - len(cached)) + (request.n - 1) * (total - full)
        if need > self.pages.available:
            return False
        self.pages.share(cached)
        first = cached + self.pages.allocate(total - len(cached))
        logits = self._prefill(prompt, len(cached) * size, first)
        self.pages.remember(prefix_keys(prompt[: full * size], size), first[:full])
        tables = [first]
        for _ in range(1, request.n):
            own = self.pages.allocate(total - full)
            if partial:  # the prompt's last page: the sample's own copy, written after it
                self.pool = self.steps.copy_page(self.pool, first[full], own[0])
            self.pages.share(first[:full])
            tables.append(first[:full] + own)
        samples = [
            _Sequence(request.request_id, i, prompt, params, tables[i], request.on_token)
            for i in range(request.n)
        ]
        seeds = [_seed(params.seed, i) for i in range(request.n)]
        rows = bucket(request.n, 1, self.max_slots)
        firsts = self.steps.draw(
            jnp.repeat(logits, rows, axis=0),
            *_sampling_arrays([params] * request.n, seeds, rows),
            jnp.full((rows,), len(prompt), jnp.int32),
            Draw.of([params]),
        )
        for seq, token in zip(samples, np.asarray(firsts)):
            self.active.append(seq)
            self._append(seq, int(token))
        return True

    def _prefill(self, prompt: np.ndarray, start: int, table: list[int]) -> jax.Array:
        """Logits [1, V] of the prompt's last token, its tokens from `start` on written."""
        rest = prompt[start:]
        t = bucket(len(rest), SMALLEST_PREFILL, max(SMALLEST_PREFILL, self.max_length))
        ids = np.zeros((1, t), np.int32)
        ids[0, t - len(rest) :] = rest
        width = self._width((len(prompt) - 1) // self.page_size + 1)
        logits, self.pool = self.steps.prefill(
            self.state,
            self.pool,
            jnp.asarray(ids),
            jnp.asarray([start], jnp.int32),
            jnp.asarray(self._tables([table], 1, width)),
            jnp.asarray([t - len(rest)], jnp.int32),
        )
        return logits

    def _decode(self) -> None:
        rows = bucket(len(self.active), 1, self.max_slots)
        seqs = self.active
        ids = np.zeros((rows, 1), np.int32)
        start = np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            ids[r, 0], start[r] = seq.generated[-1], seq.position
        seeds = [_seed(s.params.seed, s.index) for s in seqs]
        width = self._width(max(s.position for s in seqs) // self.page_size + 1)
        tokens, self.pool = self.steps.decode(
            self.state,
            self.pool,
            jnp.asarray(ids),
            jnp.asarray(start),
            jnp.asarray(self._tables([s.pages for s in seqs], rows, width)),
            *_sampling_arrays([s.params for s in seqs], seeds, rows),
            Draw.of([s.params for s in seqs]),
        )
        for seq, token in zip(list(seqs), np.asarray(tokens)):
            self._append(seq, int(token))

    def _width(self, pages: int) -> int:
        """Page-table columns of a step whose rows use up to `pages` pages."""
        return bucket(pages, SMALLEST_TABLE, self.max_pages)

    def _tables(self, tables: list[list[int]], rows: int, width: int) -> np.ndarray:
        """[rows, width] page tables: each sequence's first `width` pages (the ones it has
        written so far or writes now; it holds the rest for its later tokens)."""
        out = np.zeros((rows, width), np.int32)  # page 0: the garbage page
        for r, pages in enumerate(tables):
            out[r, : min(len(pages), width)] = pages[:width]
        return out

    def _append(self, seq: _Sequence, token: int) -> None:
        """A new token of `seq`; it finishes on an end id, a stop string or max_tokens."""
        seq.generated.append(token)
        if seq.on_token is not None:
            seq.on_token(seq.request_id, seq.index, token)
        params = seq.params
        ended = (token in self.eos and not params.ignore_eos) or token in params.stop_token_ids
        text_stop = False
        if params.stop and self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
            cut = [seq.text.find(s) for s in params.stop if s in seq.text]
            if cut:
                seq.text, text_stop = seq.text[: min(cut)], True
        if ended or text_stop:
            self._finish(seq, "stop")
        elif len(seq.generated) >= params.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: _Sequence, reason: str) -> None:
        self.active.remove(seq)
        self.pages.release(seq.pages)
        text = seq.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        self.finished.append(
            Completion(seq.request_id, seq.index, seq.prompt.tolist(), seq.generated, text, reason)
        )


def pool_sharding(state: Any) -> jax.sharding.Sharding:
    """Where the page pool lives: replicated over the mesh the model's arrays are on (each
    device computes attention for the rows it holds), or on the model's device."""
    leaf = next(x for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def _seed(seed: int, index: int) -> int:
    """The draw seed of sample `index` of a request seeded `seed` (distinct per sample)."""
    return (int(seed) * 1_000_003 + index) % (2**32)


def _sampling_arrays(params: list[SamplingParams], seeds: list[int], rows: int) -> list[Any]:
    """[rows] arrays of temperature, top_k, top_p and seed (idle rows greedy)."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seed = np.zeros(rows, np.uint32)
    for r, (p, s) in enumerate(zip(params, seeds)):
        temperature[r], top_k[r], top_p[r], seed[r] = p.temperature, p.top_k, p.top_p, s
    return [jnp.asarray(a) for a in (temperature, top_k, top_p, seed)]


def _eos_ids(given: Sequence[int] | None, tokenizer: Any, config: Any) -> list[int]:
    if given is not None:
        return [int(e) for e in given]
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    return [int(e) for e in eos if e is not None]

"""The generation engine: requests in a queue, a scheduler admitting them into free slots,
a paged KV cache, compiled prefill and decode steps (serving/steps.py); docs/serving.md tells
the whole of it.

    engine = Engine(model, tokenizer=tokenizer, max_slots=8)
    [completion] = engine.generate([prompt_ids], SamplingParams(max_tokens=32))[0]

Each `step()` (1) admits waiting requests in order while slots and pages allow (a request's
n samples together: the prompt's full pages shared, its last page each sample's own);
(2) prefills one chunk of the admitted prompts, several rows in one call of at most
`prefill_tokens` padded tokens, so decoding goes on between a long prompt's chunks (short
prompts too are cut where whole ones would pad more: prefill_plan.py); the samples of every
prompt it finishes draw their first token in it; (3) decodes one token for
every active sequence (or `decode_steps` tokens in one call: `_many_steps`), in
bucketed rows and page-table widths (x2 apart; a prefill's x4).
Pages are taken as sequences grow; when none is free the youngest sequences are preempted
(freed, recomputed later: a draw depends only on the seed and the position, so no token
changes). A finished sequence frees its slot and pages at once; full pages stay cached as
prefixes (LRU), dropped by `update_state(state)`, which swaps in live parameters (GRPO's
policy) without a recompile. `warm_up()` compiles every bucket a request can reach.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.serving import requests
from jaxtrain.serving.adapters import adapter_count
from jaxtrain.serving.decode_weights import decode_view
from jaxtrain.serving.engine_options import check_engine_options, check_max_length, check_request
from jaxtrain.serving.images import ImageInputs
from jaxtrain.serving.paged import PageAllocator, empty_pool, prefix_keys
from jaxtrain.serving.pool import pool_pages, pool_sharding
from jaxtrain.serving.prefill_plan import PrefillPlan, prefill_costs, rows_that_fit
from jaxtrain.serving.requests import (
    Completion,
    OnToken,
    Prefill,
    Request,
    eos_ids,
    sample_seed,
)
from jaxtrain.serving.sampling import SamplingParams, sampling_arrays
from jaxtrain.serving.speculation import ngram_draft
from jaxtrain.serving.steps import (
    PREFILL_GROWTH,
    Steps,
    adapter_rows,
    bucket,
    chunk_tokens,
    page_tables,
    table_width,
)
from jaxtrain.serving.warm_up import compile_every_bucket

__all__ = ["Completion", "Engine"]


class Engine:
    """See the module docstring. `model`: an NNX model of a family with a KV cache (the
    Llama family and its dropless MoE, Gemma 2 / 3, GPT-2); `max_slots`: sequences decoded
    at once; `page_size`: tokens per page; `max_length`: prompt + new tokens of one
    sequence (default the model's context); `num_pages`: the pool (default enough for every
    slot at max_length; or `kv_cache_gib` of memory; or `memory_fraction` of the device's free
    memory, on a GPU or TPU); `prefill_tokens`: the tokens (padding included) one prefill call
    writes, a bound on how long it holds up the sequences decoding; `speculative_tokens`: k > 0
    drafts up to k tokens per sequence from its own text and verifies them in one step
    (speculation.py; outputs unchanged); `decode_steps`: k > 1 decodes up to k tokens per
    sequence in one call while nothing waits to be prefilled (`_many_steps`; outputs
    unchanged; not with speculative_tokens); `attention`: how decode steps read the pages,
    "gather", "pallas" (in place, by JAX's Pallas kernel of the GPU or TPU) or "interpret"
    (paged.PagedSlots); "auto" is "gather" until the kernel has been measured on a device;
    `eos_token_ids`: default the tokenizer's or the
    config's; `logprobs_mode`: "raw" (the model's distribution) or "processed" (after each
    request's temperature, what an RL trainer scores a token with: sampling.py);
    `max_images`: a vision-language model's images per prompt (serving/images.py);
    `record_routing`: a mixture-of-experts model's pool also keeps the experts each token went
    to, returned with each completion (`Completion.routing`: GRPO's routing replay)."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        tokenizer: Any = None,
        max_slots: int = 8,
        page_size: int = 16,
        max_length: int | None = None,
        num_pages: int | None = None,
        kv_cache_gib: float | None = None,
        memory_fraction: float | None = None,
        prefill_tokens: int = 512,
        speculative_tokens: int = 0,
        decode_steps: int = 1,
        attention: str = "auto",
        eos_token_ids: Sequence[int] | None = None,
        logprobs_mode: str = "raw",
        max_images: int = 1,
        record_routing: bool = False,
    ):
        check_engine_options(model, max_slots=max_slots, page_size=page_size,
                             prefill_tokens=prefill_tokens, speculative_tokens=speculative_tokens,
                             decode_steps=decode_steps, attention=attention, logprobs_mode=logprobs_mode,
                             record_routing=record_routing)  # fmt: skip
        config = model.config
        self.tokenizer, self.max_slots, self.page_size = tokenizer, max_slots, page_size
        self.vocab_size = config.vocab_size
        self.prefill_tokens, self.speculative_tokens = prefill_tokens, speculative_tokens
        self.decode_steps = decode_steps
        self.max_length = check_max_length(model, max_length or config.max_position_embeddings)
        self.max_pages = math.ceil(self.max_length / page_size)
        view, flipped = decode_view(model)  # CPU: kernels read as [out, in] copies
        self.graphdef, self.state = nnx.split(view)
        sharding = pool_sharding(self.state)
        if num_pages is None:
            num_pages = pool_pages(model, page_size, max_slots * self.max_pages + 1,
                                   kv_cache_gib=kv_cache_gib, memory_fraction=memory_fraction,
                                   sharding=sharding, routing=record_routing)  # fmt: skip
        self.record_routing = record_routing
        pool = empty_pool(model, num_pages, page_size, routing=record_routing)
        self.pool = jax.device_put(pool, sharding)
        self.pages = PageAllocator(num_pages, page_size)
        if attention == "auto":  # the kernel has not run on a GPU or TPU yet: not a default
            attention = "gather"
        platform = next(iter(sharding.device_set)).platform
        self.prefill_plan = PrefillPlan(prefill_tokens, max_slots, prefill_costs(platform))
        self.steps = Steps(self.graphdef, page_size, sharding, attention,
                           logprobs_mode == "processed", decode_steps, flipped)  # fmt: skip
        self.params = self.steps.params(self.state)  # what the steps take (steps.py)
        self.eos = set(eos_ids(eos_token_ids, tokenizer, config))
        self.images = ImageInputs.of(config, max_images)  # None: the model takes no images
        self.adapters = adapter_count(model)  # LoRA adapters a request may choose (adapters.py)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Prefill] = []
        self.active: list[requests.Sequence] = []
        self.finished: list[Completion] = []
        self.preemptions = 0  # sequences preempted so far (recomputed later)
        self.drafted = self.accepted = 0  # speculative tokens proposed and kept so far
        self._ids = itertools.count()

    # ------------------------------------------------------------ requests
    def update_state(self, state: Any) -> None:
        """Decode from these parameters from now on (the same structure: no recompile). The
        cached prompt prefixes go: their keys and values were computed by the old ones."""
        self.state, self.params = state, self.steps.params(state)
        self.pages.forget_prefixes()

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        n: int = 1,
        on_token: OnToken | None = None,
        images: Any = None,
        adapter: int = 0,
    ) -> int:
        """Queue a request of `n` samples; returns its id. `on_token(request_id, index,
        token, logprob, top)` is called for every new token (streaming; requests.OnToken).
        `images` [n, C, H, W]: the pixels of the prompt's images, in the order of their runs
        of image tokens (a vision-language model's; serving/images.py). `adapter`: the LoRA
        adapter it runs through (serving/adapters.py: i for the i-th loaded; 0 the base)."""
        params = params or SamplingParams()
        prompt = check_request(prompt_ids, params, n, vocab_size=int(self.vocab_size),
                               max_length=self.max_length, max_slots=self.max_slots,
                               page_size=self.page_size, pages=self.pages.num_pages - 1)  # fmt: skip
        if self.images is not None:
            images = self.images.check(prompt, images, self.prefill_tokens)
        elif images is not None:
            raise ArgumentError(f"{type(self.graphdef).__name__}: this model takes no images")
        if not 0 <= adapter <= self.adapters:
            raise ArgumentError(f"adapter {adapter}: this engine has {self.adapters} (0: none)")
        request_id = next(self._ids)
        self.waiting.append(
            Request(request_id, prompt, params, n, on_token, images=images, adapter=adapter)
        )
        return request_id

    def cancel(self, request_id: int) -> None:
        """Drop a request: waiting, prefilling or decoding (its slots and pages are freed)."""
        self.waiting = collections.deque(r for r in self.waiting if r.request_id != request_id)
        for item in [p for p in self.prefilling if p.request.request_id == request_id]:
            self.prefilling.remove(item)
            for table in item.tables:
                self.pages.release(table)
        for seq in [s for s in self.active if s.request_id == request_id]:
            self.active.remove(seq)
            self.pages.release(seq.pages)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.prefilling and not self.active

    @property
    def slots_in_use(self) -> int:
        return len(self.active) + sum(p.request.n for p in self.prefilling)

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
        """Admit what fits, write one prefill chunk, decode one token for every active
        sequence; returns the sequences that finished in this step."""
        self.finished = []
        self._admit()
        if not self.active and not self.prefilling and self.waiting:
            request = self.waiting[0]
            raise ArgumentError(
                f"request {request.request_id} ({len(request.prompt)} prompt tokens, "
                f"max_tokens {request.params.max_tokens}, n={request.n}) does not fit the KV "
                f"cache even alone ({self.pages.available} free pages of {self.page_size}); "
                "raise num_pages"
            )
        if self.prefilling:
            self._prefill()
        if self.active:
            self._decode()
        return self.finished

    def _admit(self) -> None:
        while self.waiting and self.slots_in_use + self.waiting[0].n <= self.max_slots:
            request = self.waiting[0]
            held = self.pages.hold_prompt(
                request.prompt, request.n, request.adapter, cached=request.images is None
            )  # an image's pages are not known by their token ids (images.py): never cached
            if held is None:
                return
            tables, cached_tokens = held
            self.waiting.popleft()
            self.prefilling.append(Prefill(request, tables, done=cached_tokens))

    def _chunk(self) -> list[tuple[Prefill, int]]:
        """The prompts the next prefill call writes and how many tokens of each: in order,
        at most `prefill_plan.prefill_cap` of each, while the call's padded size (row bucket
        x token bucket) stays within the budget."""
        cap = self.prefill_tokens
        if all(item.request.images is None for item in self.prefilling):
            cap = self.prefill_plan.cap(self.prefilling)
        takes = []
        for item in self.prefilling:
            take = min(item.remaining, cap)
            if item.request.images is not None:  # an image's tokens go in one call
                take = self.images.cut(item.request.prompt, item.done, take)
            takes.append(take)
        n = rows_that_fit(takes, self.prefill_tokens, self.max_slots)
        return list(zip(self.prefilling[:n], takes[:n]))

    def _prefill(self) -> None:
        chunk = self._chunk()
        r = bucket(len(chunk), 1, self.max_slots)
        t = chunk_tokens(max(take for _, take in chunk), self.prefill_tokens)
        ids = np.zeros((r, t), np.int32)
        start = np.zeros(r, np.int32)
        pad = np.full(r, t, np.int32)  # idle rows: all padding, written to the garbage page
        ends = []
        for row, (item, take) in enumerate(chunk):
            ids[row, t - take :] = item.request.prompt[item.done : item.done + take]
            start[row], pad[row] = item.done, t - take
            ends.append(item.done + take)
        pages = max((end - 1) // self.page_size + 1 for end in ends)
        width = table_width(pages, self.max_pages, self.page_size, PREFILL_GROWTH)
        tables = page_tables([item.tables[0] for item, _ in chunk], r, width)
        # The samples of every prompt this chunk finishes draw their first token in the call.
        starting = []
        for row, (item, take) in enumerate(chunk):
            item.done += take
            if not item.remaining:
                resumed = item.request.resume
                indices = [resumed.index] if resumed else range(item.request.n)
                starting += [(row, item, i) for i in indices]
        rows = np.zeros(self.max_slots, np.int32)
        positions = np.zeros(self.max_slots, np.int32)
        for s, (row, item, _) in enumerate(starting):
            rows[s], positions[s] = row, len(item.request.prompt)
        sampling = sampling_arrays(
            [item.request.params for _, item, _ in starting],
            [sample_seed(item.request.params.seed, i) for _, item, i in starting],
            self.max_slots,
        )
        adapters = np.zeros(r, np.int32)
        adapters[: len(chunk)] = [item.request.adapter for item, _ in chunk]
        arrays = (ids, start, tables, pad, adapters, rows, positions)
        if any(item.request.images is not None for item, _ in chunk):
            written = [(item.request, end - take, take) for (item, take), end in zip(chunk, ends)]
            pixels = self.images.chunk(written, r)
            drawn, self.pool = self.steps.prefill_images(
                self.params, self.pool, *arrays, pixels, *sampling
            )
        else:
            drawn, self.pool = self.steps.prefill(self.params, self.pool, *arrays, *sampling)
        if starting:
            self._start(starting, jax.device_get(drawn))

    def _start(self, starting: list[tuple[int, Prefill, int]], drawn: Any) -> None:
        """The samples of prompts now in the cache begin decoding with their first tokens."""
        size = self.page_size
        for s, (_, item, i) in enumerate(starting):
            request, prompt = item.request, item.request.prompt
            full = len(prompt) // size
            k = 0 if request.resume else i  # the sample's page table
            if k == 0:
                self.prefilling.remove(item)
                if request.images is None:
                    keys = prefix_keys(prompt[: full * size], size, request.adapter)
                    self.pages.remember(keys, item.tables[0][:full])
            elif len(prompt) % size:  # the prompt's last page: this sample's own copy
                self.pool = self.steps.copy_page(
                    self.pool, item.tables[0][full], item.tables[k][full]
                )
            seq = request.resume or requests.Sequence(
                request.request_id, i, prompt, request.params, [], request.on_token,
                images=request.images, adapter=request.adapter,
            )  # fmt: skip
            seq.pages = item.tables[k]
            self.active.append(seq)
            self._append(seq, drawn, s)

    def _grow(self) -> None:
        """A page for every sequence whose next token starts one, preempting the youngest
        sequences while the pool has none (the oldest always fits: submit checked that one
        sequence fits the whole pool)."""
        for seq in list(self.active):
            if seq not in self.active or seq.position // self.page_size < len(seq.pages):
                continue
            while not self.pages.available:
                self._preempt_youngest()
            if seq in self.active:
                seq.pages += self.pages.allocate(1)

    def _preempt_youngest(self) -> None:
        """Free the pages of the request admitted last (a prompt being prefilled) or of the
        sequence that started decoding last; it waits at the head of the queue."""
        self.preemptions += 1
        if self.prefilling:
            item = self.prefilling.pop()
            for table in item.tables:
                self.pages.release(table)
            self.waiting.appendleft(item.request)
            return
        seq = self.active.pop()
        self.pages.release(seq.pages)
        self.waiting.appendleft(seq.preempted())

    def _decode(self) -> None:
        """One call for every active sequence: one token each; `decode_steps` tokens each
        (`_many_steps`); or each one's newest token and its speculative draft, keeping the
        draft tokens its own sampler confirms (speculation.py)."""
        many = self._many_steps()
        if many == 1:
            self._grow()
        if not self.active:
            return
        seqs = list(self.active)
        drafts = self._drafts() if self.speculative_tokens else [[] for _ in seqs]
        speculating = any(len(d) for d in drafts)
        rows = bucket(len(seqs), 1, self.max_slots)
        ids = np.zeros((rows, 1 + self.speculative_tokens if speculating else 1), np.int32)
        # Tokens each row may draw in a call of several steps; a draft's length when verifying.
        start, extra = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, (seq, draft) in enumerate(zip(seqs, drafts)):
            ids[r, 0], ids[r, 1 : 1 + len(draft)] = seq.generated[-1], draft
            start[r] = seq.position
            extra[r] = len(draft) if speculating else self._tokens_ahead(seq, many)
        last = max(s.position + int(n) - (not speculating) for s, n in zip(seqs, extra))
        width = table_width(last // self.page_size + 1, self.max_pages, self.page_size)
        tables = page_tables([s.pages for s in seqs], rows, width)
        adapters = adapter_rows([s.adapter for s in seqs], rows)
        inputs = (self.params, self.pool, ids, start, tables, adapters)
        seeds = [sample_seed(s.params.seed, s.index) for s in seqs]
        sampling = sampling_arrays([s.params for s in seqs], seeds, rows)
        if speculating:
            drawn, kept, self.pool = self.steps.verify(*inputs, extra, *sampling)
            drawn, counts = jax.device_get((drawn, kept + 1))
            self.drafted += int(extra.sum())
        elif many > 1:
            drawn, self.pool = self.steps.decode_many(*inputs, extra, *sampling)
            drawn, counts = jax.device_get(drawn), extra
        else:
            drawn, self.pool = self.steps.decode(*inputs, *sampling)
            drawn, counts = jax.tree.map(lambda x: x[:, None], jax.device_get(drawn)), extra
        for r, seq in enumerate(seqs):
            row = drawn.row(r)
            for j in range(int(counts[r])):
                if seq not in self.active:  # ended at an earlier token of this call
                    break
                self.accepted += speculating and j > 0
                self._append(seq, row, j)

    def _tokens_ahead(self, seq: requests.Sequence, steps: int) -> int:
        """Tokens `seq` may still draw in a call of `steps` steps (no more than max_tokens)."""
        return min(steps, seq.params.max_tokens - len(seq.generated))

    def _many_steps(self) -> int:
        """Steps of the next decode call: `decode_steps` while no prompt waits for a free
        slot or is being prefilled (it would wait k steps, not one) and the pool has pages for
        every sequence's next k tokens (a call never preempts; it takes them here); else 1.
        One call of k steps feeds each draw back as the next token inside one compiled scan:
        the host builds the arrays, dispatches and reads back once per k tokens, which on a GPU
        was most of a step (bench/RESULTS.md, 2026-11-29). A draw depends only on the seed and
        the position, so the tokens are those of single steps."""
        k = self.decode_steps
        if k == 1 or self.prefilling or not self.active:
            return 1
        if self.waiting and self.slots_in_use + self.waiting[0].n <= self.max_slots:
            return 1
        size = self.page_size
        need = [max(0, (s.position + self._tokens_ahead(s, k) - 1) // size + 1 - len(s.pages))
                for s in self.active]  # fmt: skip
        if sum(need) > self.pages.available:
            return 1
        for seq, more in zip(self.active, need):
            seq.pages += self.pages.allocate(more) if more else []
        return k

    def _drafts(self) -> list[np.ndarray]:
        """Each active sequence's draft: at most speculative_tokens, no more than it may still
        generate after the next token, and no more than its pages hold (a page is taken for a
        draft only while one is free: a draft never preempts)."""
        drafts = []
        for seq in self.active:
            room = seq.params.max_tokens - len(seq.generated) - 1
            tokens = np.concatenate([seq.prompt, np.asarray(seq.generated, np.int32)])
            draft = ngram_draft(tokens, min(self.speculative_tokens, room))
            more = (seq.position + len(draft)) // self.page_size + 1 - len(seq.pages)
            if more > 0 and self.pages.available >= more:
                seq.pages += self.pages.allocate(more)
            drafts.append(draft[: len(seq.pages) * self.page_size - 1 - seq.position])
        return drafts

    def _append(self, seq: requests.Sequence, drawn: Any, row: int) -> None:
        """Row `row` of a step's draw is `seq`'s new token; it finishes on an end id, a stop
        string or max_tokens."""
        params = seq.params
        token, logprob = int(drawn.tokens[row]), float(drawn.logprobs[row])
        top = None
        if params.logprobs:
            k = params.logprobs
            top = dict(zip(drawn.top_ids[row, :k].tolist(), drawn.top_logprobs[row, :k].tolist()))
            seq.top_logprobs.append(top)
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        if seq.on_token is not None:
            seq.on_token(seq.request_id, seq.index, token, logprob, top)
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

    def _finish(self, seq: requests.Sequence, reason: str) -> None:
        self.active.remove(seq)
        routing = None
        if self.record_routing:  # every written token's experts, read before the pages go
            routing = self.steps.routing(self.pool, seq.pages, self.max_pages)[:, : seq.position]
        # Its written pages stay cached like a prompt's, for a request continuing its text (the
        # newest token has no KV yet: it would be the next step's input).
        full, size = seq.position // self.page_size, self.page_size
        if seq.images is None:
            keys = prefix_keys(seq.tokens[: full * size], size, seq.adapter)
            self.pages.remember(keys, seq.pages[:full])
        self.pages.release(seq.pages)
        text = seq.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        self.finished.append(seq.completion(text, reason, routing))

    # ------------------------------------------------------------ start-up
    def warm_up(
        self, max_prompt_tokens: int | None = None, max_prefill_rows: int | None = None
    ) -> int:
        """Compile every bucket a request can reach (prompts up to `max_prompt_tokens`, default
        max_length; at most `max_prefill_rows` prompts waiting at once, default max_slots), so
        that serving compiles nothing; returns how many shapes it compiled (warm_up.py)."""
        return compile_every_bucket(self, max_prompt_tokens, max_prefill_rows)

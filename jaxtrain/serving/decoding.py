"""The decode half of the engine's step (serving/engine.py): one token for every active
sequence, `decode_steps` tokens in one call, or a speculative draft verified in one call.

A call of k steps (`Engine(decode_steps=k)`) feeds each row's draw back as its next token
inside one compiled scan, so the host builds the step's arrays, dispatches and reads the
tokens back once per k tokens instead of once per token: on a GPU the host's work was most of
a decode step (bench/RESULTS.md, 2026-11-29). Each draw depends only on the seed and the
position, so the tokens are those of single steps. The engine takes k steps only while no
prompt is waiting for a free slot or being prefilled (they would wait k steps, not one) and
while the pool has pages for every sequence's next k tokens (a call never preempts); else
one.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.serving import requests
from jaxtrain.serving.requests import sample_seed
from jaxtrain.serving.sampling import Drawn, sampling_arrays
from jaxtrain.serving.speculation import ngram_draft
from jaxtrain.serving.steps import bucket

__all__ = ["DecodeSteps"]


def row_of(drawn: Drawn, r: int) -> Drawn:
    """Row r of a draw whose arrays have a step axis after the row's: its [steps] tokens."""
    return Drawn(drawn.tokens[r], drawn.logprobs[r], drawn.top_ids[r], drawn.top_logprobs[r])


class DecodeSteps:
    """Engine's decode methods (a mixin: they read and write the engine's sequences, pages
    and pool; Engine's docstring lists those)."""

    def _decode(self) -> None:
        many = self._many_steps()
        if many == 1:
            self._grow()
        if not self.active:
            return
        drafts = self._drafts() if self.speculative_tokens else []
        if any(len(d) for d in drafts):
            self._verify(drafts)
            return
        seqs = list(self.active)
        rows = bucket(len(seqs), 1, self.max_slots)
        ids = np.zeros((rows, 1), np.int32)
        start, limit = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            ids[r, 0], start[r] = seq.generated[-1], seq.position
            limit[r] = self._tokens_ahead(seq, many)
        seeds = [sample_seed(s.params.seed, s.index) for s in seqs]
        last = max(s.position + int(n) - 1 for s, n in zip(seqs, limit))
        width = self._width(last // self.page_size + 1)
        arrays = (ids, start, self._tables([s.pages for s in seqs], rows, width),
                  self._adapters(seqs, rows))  # fmt: skip
        arrays = tuple(map(jax.device_put, arrays))
        sampling = sampling_arrays([s.params for s in seqs], seeds, rows)
        if many == 1:
            drawn, self.pool = self.steps.decode(self.state, self.pool, *arrays, *sampling)
            drawn = jax.device_get(drawn)
            for r, seq in enumerate(seqs):
                self._append(seq, drawn, r)
            return
        drawn, self.pool = self.steps.decode_many(
            self.state, self.pool, *arrays, jax.device_put(limit), *sampling
        )
        drawn = jax.device_get(drawn)
        for r, seq in enumerate(seqs):
            row = row_of(drawn, r)
            for j in range(int(limit[r])):
                if seq not in self.active:  # ended at an earlier token of this call
                    break
                self._append(seq, row, j)

    def _tokens_ahead(self, seq: requests.Sequence, steps: int) -> int:
        """Tokens `seq` may still draw in a call of `steps` steps (no more than max_tokens)."""
        return min(steps, seq.params.max_tokens - len(seq.generated))

    def _many_steps(self) -> int:
        """Steps of the next decode call (module docstring); with k > 1 it takes the pages the
        call writes."""
        k = self.decode_steps
        if k == 1 or self.prefilling or not self.active:
            return 1
        if self.waiting and self.slots_in_use + self.waiting[0].n <= self.max_slots:
            return 1
        size = self.page_size
        need = [
            max(0, (s.position + self._tokens_ahead(s, k) - 1) // size + 1 - len(s.pages))
            for s in self.active
        ]
        if sum(need) > self.pages.available:
            return 1
        for seq, more in zip(self.active, need):
            if more:
                seq.pages += self.pages.allocate(more)
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

    def _verify(self, drafts: list[np.ndarray]) -> None:
        """One step that feeds every sequence's newest token and its draft, keeping the draft
        tokens its own sampler confirms (speculation.py)."""
        seqs, k = list(self.active), self.speculative_tokens
        rows = bucket(len(seqs), 1, self.max_slots)
        ids = np.zeros((rows, 1 + k), np.int32)
        start, drafted = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, (seq, draft) in enumerate(zip(seqs, drafts)):
            ids[r, 0], ids[r, 1 : 1 + len(draft)] = seq.generated[-1], draft
            start[r], drafted[r] = seq.position, len(draft)
        seeds = [sample_seed(s.params.seed, s.index) for s in seqs]
        last = max(s.position + len(d) for s, d in zip(seqs, drafts))
        width = self._width(last // self.page_size + 1)
        drawn, kept, self.pool = self.steps.verify(
            self.state, self.pool, *map(jax.device_put, (ids, start)),
            jax.device_put(self._tables([s.pages for s in seqs], rows, width)),
            jax.device_put(self._adapters(seqs, rows)),
            jax.device_put(drafted), *sampling_arrays([s.params for s in seqs], seeds, rows),
        )  # fmt: skip
        drawn, kept = jax.device_get((drawn, kept))
        self.drafted += int(drafted.sum())
        for r, seq in enumerate(seqs):
            row = row_of(drawn, r)
            for j in range(int(kept[r]) + 1):
                if seq not in self.active:  # ended at an earlier token of this step
                    break
                self.accepted += j > 0
                self._append(seq, row, j)

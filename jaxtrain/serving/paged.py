"""The paged KV cache: fixed-size pages in one pool per layer, a page table per sequence.

Device side (`PagedSlots`, used inside the compiled steps): every layer's keys and values live
in a pool [num_pages, page_size, K, H]; a sequence's token at logical position p sits in page
`table[p // page_size]` at offset `p % page_size`. `PagedSlots` has the interface of
models/kv_cache.py's `Slots` (positions, mask, write, read), so every family's cached decoder
runs on pages unchanged: `write` scatters the new tokens into their pages, `read` gathers each
row's pages into the [B, L, K, H] view attention reads. Page 0 is never handed out: writes of
padding and of idle rows land there, and no sequence reads it as a visible key.

Host side (`PageAllocator`): free pages, reference counts (a prompt's full pages are shared by
every sequence that starts with it), and the index of cached prompt prefixes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.errors import JaxtrainError
from jaxtrain.models.attention import attention_probs

__all__ = [
    "CacheFull",
    "PageAllocator",
    "PagedSlots",
    "decode_row_group",
    "empty_pool",
    "is_sparse",
    "page_bytes",
    "routing_of",
]

Array = jax.Array
GARBAGE_PAGE = 0


class CacheFull(JaxtrainError):
    """No free page for a sequence that needs one (the scheduler waits or says so)."""


def page_bytes(model: Any, page_size: int, routing: bool = False) -> int:
    """Bytes one page takes over every layer (keys and values; and with `routing`, a MoE's
    recorded experts)."""
    c = model.config
    per_layer = 2 * page_size * c.num_key_value_heads * c.head_dim
    kv = per_layer * c.num_hidden_layers * jnp.dtype(model.dtype).itemsize
    sparse = sum(routing and is_sparse(model, i) for i in range(c.num_hidden_layers))
    return kv + sparse * page_size * _experts_per_token(model) * 4


def is_sparse(model: Any, layer: int) -> bool:
    """Whether `layer` of `model` routes its tokens to experts (a MoE's sparse layer)."""
    return bool(getattr(model.config, "is_sparse_layer", lambda i: False)(layer))


def _experts_per_token(model: Any) -> int:
    return int(getattr(model.config, "num_experts_per_tok", 0))


def empty_pool(model: Any, num_pages: int, page_size: int, routing: bool = False) -> list[tuple]:
    """Every layer's (keys, values) pool [K, num_pages, page_size, H] in the model's dtype
    (kv heads first: the layout the Pallas paged-attention kernels read in place). With
    `routing`, a MoE's sparse layers hold a third pool [1, num_pages, page_size, k]: the
    experts each written token went to (-1: none written), read back by `routing_of`."""
    c = model.config
    shape = (c.num_key_value_heads, num_pages, page_size, c.head_dim)
    routes = (1, num_pages, page_size, _experts_per_token(model))
    return [
        (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
        + ((jnp.full(routes, -1, jnp.int32),) if routing and is_sparse(model, i) else ())
        for i in range(c.num_hidden_layers)
    ]


def routing_of(pool: list[tuple], table: Array) -> Array:
    """[S, W * page_size, k]: the experts recorded for a sequence's tokens in order, in each
    of the pool's S routing layers (`table` [W]: its pages)."""
    routes = [layer[2][0, table] for layer in pool if len(layer) == 3]  # [W, page_size, k]
    return jnp.stack([r.reshape(-1, r.shape[-1]) for r in routes])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedSlots:
    """Where T new tokens of B rows go in a paged cache, and what each row sees.

    `logical` [B, T]: each new token's position in its sequence, -1 for the left padding of
    a prefill (written to the garbage page; it sees only key 0, so its softmax stays finite);
    `table` [B, max_pages]: each row's physical pages in order; `kernel`: how a decode step
    (one new token per row) attends: "gather" (the pages gathered into a contiguous view, as
    every step of several tokens does), "pallas" (JAX's Pallas paged-attention kernel of the
    platform, GPU or TPU, reading the pages in place) or "interpret" (the GPU kernel in
    Pallas' interpret mode: the kernel's own code on any platform, for tests); `row_group`:
    a gathered decode step of more rows gathers that many rows' pages at a time, in a loop
    (rows in order of length, each group as much of the table as its longest row reaches),
    and forms its scores keys-first (`_keys_times_queries`; 0: all at once, queries first, as
    GPUs and TPUs do; `decode_row_group` says which suits the pool's platform)."""

    logical: Array
    table: Array
    page_size: int = dataclasses.field(metadata=dict(static=True))
    kernel: str = dataclasses.field(default="gather", metadata=dict(static=True))
    row_group: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def of(
        cls,
        start: Array,
        tokens: int,
        table: Array,
        page_size: int,
        pad: Array | None = None,
        kernel: str = "gather",
        row_group: int = 0,
    ) -> PagedSlots:
        """`tokens` new tokens per row: `pad` [B] padding tokens first (default none), then
        the real ones from logical position `start` [B] on."""
        pad = jnp.zeros_like(start) if pad is None else pad
        index = jnp.arange(tokens, dtype=jnp.int32)[None, :]
        logical = jnp.where(index < pad[:, None], -1, start[:, None] + index - pad[:, None])
        return cls(logical, table, page_size, kernel, row_group)

    @property
    def positions(self) -> Array:
        """[B, T] rotary / learned positions (padding clamped to 0; its output is unused)."""
        return jnp.maximum(self.logical, 0)

    @property
    def length(self) -> int:
        return self.table.shape[1] * self.page_size

    @property
    def key_index(self) -> Array:
        """[B, T]: the key column (logical position) of each new token, -1 for padding."""
        return self.logical

    @property
    def key_count(self) -> int:
        return self.length

    def mask(self, window: int | None = None) -> Array:
        """[B, 1, T, L]: key j is visible to a query at position p when 0 <= j <= p (and,
        with a sliding `window`, p - j < window)."""
        p = self.logical[:, :, None]
        j = jnp.arange(self.length, dtype=jnp.int32)[None, None, :]
        visible = (j <= p) & (p >= 0)
        if window is not None:
            visible &= p - j < window
        return (visible | ((p < 0) & (j == 0)))[:, None]

    def write(self, pool: tuple[Array, Array], k: Array, v: Array) -> tuple[Array, Array]:
        """The layer's pool with the new tokens' keys and values [B, T, K, H] scattered into
        their pages (padding and positions past a row's table into the garbage page)."""
        keys, values = pool  # [K, pages, page_size, H]
        page, offset = self._places()
        heads_first = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B, T, K, H] -> [K, B, T, H]
        return (
            keys.at[:, page, offset].set(heads_first(k).astype(keys.dtype)),
            values.at[:, page, offset].set(heads_first(v).astype(values.dtype)),
        )

    def write_routing(self, routes: Array, experts: Array) -> Array:
        """A sparse layer's routing pool [1, pages, page_size, k] with the new tokens'
        experts [B, T, k] in their slots (as `write` places their keys)."""
        page, offset = self._places()
        return routes.at[0, page, offset].set(experts.astype(routes.dtype))

    def _places(self) -> tuple[Array, Array]:
        """(page, offset) [B, T] of each new token: padding and positions past a row's
        table go to the garbage page."""
        p = self.logical
        index = p // self.page_size
        inside = (p >= 0) & (index < self.table.shape[1])
        page = jnp.take_along_axis(self.table, jnp.clip(index, 0, self.table.shape[1] - 1), axis=1)
        page = jnp.where(inside, page, GARBAGE_PAGE)  # never the table's last page, clipped
        return page, jnp.where(inside, p % self.page_size, 0)

    def read(self, keys: Array, values: Array) -> tuple[Array, Array]:
        """Each row's pages gathered in order: [B, max_pages * page_size, K, H]."""
        b, k = self.table.shape[0], keys.shape[0]

        def view(pool: Array) -> Array:  # [K, B, W, S, H] -> [B, W * S, K, H]
            pages = jnp.moveaxis(pool[:, self.table], 0, 3)
            return pages.reshape(b, self.length, k, pool.shape[-1])

        return view(keys), view(values)

    def attention(
        self,
        q: Array,
        keys: Array,
        values: Array,
        mask: Array,
        *,
        window: int | None = None,
        scale: float | None = None,
        logit_cap: float | None = None,
    ) -> Array:
        """The new tokens' attention [B, T, N, H]: a decode step's (T = 1, no sliding window)
        by the Pallas kernel when `kernel` says so, reading the pages in place; otherwise over
        the gathered pages."""
        if self.kernel == "gather" or q.shape[1] != 1 or window is not None:
            return self._gathered_attention(q, keys, values, mask, scale, logit_cap)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        query = (q[:, 0] * scale).astype(keys.dtype)  # [B, N, H]; the kernels do not scale
        lengths = (jnp.maximum(self.logical[:, 0], 0) + 1).astype(jnp.int32)
        out = paged_kernel(self.kernel)(query, keys, values, self.table, lengths, logit_cap)
        return out[:, None].astype(q.dtype)

    def _gathered_attention(self, q, keys, values, mask, scale, logit_cap) -> Array:
        """Attention over each row's pages gathered kv-heads first, [K, B, L, H] (a reshape of
        the gather), as batched matmuls whose batch dims (K, B) lead, the order XLA:CPU runs
        without transposing: a decode step of SmolLM2-135M (32 rows, 128 keys) took 2.0 ms of
        attention a layer through [B, L, K, H] and jax.nn.dot_product_attention, 1.0 here."""
        b, t, n, h = q.shape
        k = keys.shape[0]
        if t == 1 and 0 < self.row_group < b:
            rows = _divisor(b, self.row_group)
            return self._attention_by_row_groups(rows, q, keys, values, mask, scale, logit_cap)

        def gather(pool: Array) -> Array:  # [K, B, W, S, H] -> [K, B, L, H]
            return pool[:, self.table].reshape(k, b, self.length, h)

        q = jnp.moveaxis(q.reshape(b, t, k, n // k, h), 2, 0)  # [K, B, T, G, H]
        if t == 1 and self.row_group:  # a CPU decode step
            scores = _keys_times_queries(gather(keys), q)
        else:
            scores = jnp.einsum("kbtgh,kblh->kbtgl", q, gather(keys),
                                preferred_element_type=jnp.float32)  # fmt: skip
        visible = mask[:, 0][None, :, :, None, :]  # [B, 1, T, L] -> [1, B, T, 1, L]
        probs = attention_probs(scores, h, visible, scale=scale, logit_cap=logit_cap)
        out = jnp.einsum("kbtgl,kblh->kbtgh", probs.astype(values.dtype), gather(values))
        return jnp.moveaxis(out, 0, 2).reshape(b, t, n, h)

    def _attention_by_row_groups(self, rows, q, keys, values, mask, scale, logit_cap) -> Array:
        """A decode step's gathered attention `rows` rows at a time, in a loop: each group's
        pages stay in the CPU's caches between the gather and the two matmuls (all 32 rows'
        pages at once spill them; see CPU_DECODE_ROWS). The rows go in order of length, and
        a group gathers only the first columns of the table its longest row reaches, in
        steps of a CPU_DECODE_WIDTHS-th of it (one branch of a switch each): the table is as
        wide as the step's longest row rounded up to a bucket, and the other rows need less."""
        groups, width = q.shape[0] // rows, self.table.shape[1]
        order = jnp.argsort(self.logical[:, 0])  # shortest rows first
        step = -(-width // CPU_DECODE_WIDTHS)  # pages
        widths = sorted({min(w, width) for w in range(step, width + step, step)})
        reach = jnp.maximum(self.logical[order, 0], 0) // (step * self.page_size)
        branch = reach.reshape(groups, rows).max(axis=1)  # each group's widths[branch]

        def attend(pages: int):
            def attention(logical: Array, table: Array, q: Array, mask: Array) -> Array:
                slots = dataclasses.replace(self, logical=logical, table=table[:, :pages],
                                            row_group=rows)  # fmt: skip
                visible = mask[..., : pages * self.page_size]
                return slots._gathered_attention(q, keys, values, visible, scale, logit_cap)

            return attention

        def group(part: tuple[Array, ...]) -> Array:
            return jax.lax.switch(part[0], [attend(w) for w in widths], *part[1:])

        split = lambda x: x[order].reshape(groups, rows, *x.shape[1:])  # noqa: E731
        parts = (self.logical, self.table, q, mask)
        out = jax.lax.map(group, (branch, *(split(x) for x in parts)))
        return out.reshape(q.shape)[jnp.argsort(order)]


def _keys_times_queries(keys: Array, q: Array) -> Array:
    """Raw scores [K, B, T, G, L] of gathered keys [K, B, L, H] and queries [K, B, T, G, H],
    formed as [K, B, L, T, G]: each row's keys times its few queries, contracted over the keys'
    contiguous axis. In a decode step of SmolLM2-135M on XLA:CPU this product took 0.43-0.59x
    the time of the [T*G, L] one (32 rows, 256 keys: 8-11 against 19-20 ms a step over 30
    layers, profiled). The barrier keeps XLA from folding the transpose back into the dot."""
    scores = jnp.einsum("kblh,kbtgh->kbltg", keys, q, preferred_element_type=jnp.float32)
    return jnp.moveaxis(jax.lax.optimization_barrier(scores), 2, -1)


# Rows of a decode step whose pages one loop iteration gathers on CPU. SmolLM2-135M, 32 rows
# (bench/decode_step.py, this 2-core EPYC, 2 MiB L2 per core): the whole step's forward took
# 131-144 ms with a 16-page table gathered at once, 107-109 ms by 8 rows; 223-284 against
# 150-183 ms with 32 pages. GPUs and TPUs gather at once (a loop would serialize them).
CPU_DECODE_ROWS = 8
# Widths a CPU decode step's row group may gather of its W-page table: W/8, 2W/8, ... or all
# of it. bench/decode_attention.py (bench/RESULTS.md, session 44), the attention of 30 layers of
# SmolLM2-135M, 32 rows: 16-page tables with rows spread over 40-240 keys, 0.68x the time of
# gathering the whole table (4 widths: 0.86x); rows of 170-180 keys, 0.79x (0.88x); a 32-page
# table whose rows hold 100-120 keys, 0.21x. Each width is a branch compiled once per layer (a
# decode step unrolls them): SmolLM2's 32-row decode program took 18.2 s to compile against 7.7
# with one width (4 widths: 15.1 s), on a busy VM.
CPU_DECODE_WIDTHS = 8


def decode_row_group(pool_sharding: jax.sharding.Sharding) -> int:
    """PagedSlots.row_group for a pool placed by `pool_sharding`: read from the devices the
    steps compile for, not the process's backend, so that `jaxtrain plan` of a GPU or TPU
    target on a laptop compiles the target's steps."""
    platform = next(iter(pool_sharding.device_set)).platform
    return CPU_DECODE_ROWS if platform == "cpu" else 0


def paged_kernel(kernel: str):
    """(q [B, N, H], keys, values [K, pages, S, H], table [B, W], lengths [B], logit_cap) ->
    [B, N, H]: JAX's Pallas paged attention of the platform ("pallas") or the GPU kernel
    interpreted ("interpret")."""
    platform = jax.default_backend()
    if kernel == "pallas" and platform == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        def tpu(q, keys, values, table, lengths, cap):
            block = _divisor(table.shape[1], 8)
            return paged_attention(q, keys, values, lengths, table, attn_logits_soft_cap=cap,
                                   pages_per_compute_block=block)  # fmt: skip

        return tpu
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    def gpu(q, keys, values, table, lengths, cap):
        splits = _divisor(table.shape[1], 16)
        return paged_attention(
            q, keys, values, table, lengths, k_splits=splits, attn_logits_soft_cap=cap,
            pages_per_compute_block=_divisor(table.shape[1] // splits, 8),
            interpret=kernel == "interpret",
        )  # fmt: skip

    return gpu


def _divisor(n: int, most: int) -> int:
    """The largest power of two <= `most` that divides `n`."""
    d = most
    while n % d:
        d //= 2
    return d


def prefix_keys(tokens: np.ndarray, page_size: int, adapter: int = 0) -> list[str]:
    """A key per full page of `tokens`: a hash of every token up to that page's end, so a
    key names the whole prefix, not the page alone; and of the LoRA `adapter` that computed
    its keys and values (serving/adapters.py: another adapter's are other numbers)."""
    digest = hashlib.blake2b(digest_size=16)
    if adapter:
        digest.update(f"adapter {adapter}".encode())
    keys = []
    for end in range(page_size, len(tokens) + 1, page_size):
        digest.update(np.asarray(tokens[end - page_size : end], np.int32).tobytes())
        keys.append(digest.copy().hexdigest())
    return keys


class PageAllocator:
    """Free pages, reference counts and cached prompt prefixes (see the module docstring).

    A cached prefix holds one reference to its pages; a sequence using them holds one more
    each. When the pool runs short, cached prefixes that no sequence uses are evicted, least
    recently used first, and of one prefix its last pages first (its first pages are what
    other prompts share, and a prefix is found from its first page on)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.free = list(range(num_pages - 1, GARBAGE_PAGE, -1))  # pop() hands out low ids
        self.refs = np.zeros(num_pages, np.int32)
        self.prefixes: dict[str, int] = {}  # prefix key -> page (order: least recently used first)
        # The pages `prefixes` holds, as a mask: `available` counts the evictable ones in one
        # vector operation (it is read several times a decode step, the cache holds hundreds).
        self.cached = np.zeros(num_pages, bool)

    def hold_prompt(
        self, prompt: np.ndarray, n: int, adapter: int, cached: bool = True
    ) -> tuple[list[list[int]], int] | None:
        """The pages a prompt of `n` samples fills, for every sample (the full ones shared,
        the last, partial one each sample's own), and how many of its tokens a cached prefix
        already holds (`cached`: look it up); None while the pool is short. Pages for the
        tokens the samples generate are taken as they decode."""
        size = self.page_size
        total = math.ceil(len(prompt) / size)
        found = self.cached_prefix(prefix_keys(prompt[:-1], size, adapter)) if cached else []
        full = len(prompt) // size  # pages the prompt fills: shared by the other samples
        self.share(found)  # held first: the allocations below must not evict them
        if (total - len(found)) + (n - 1) * (total - full) > self.available:
            self.release(found)
            return None
        first = found + self.allocate(total - len(found))
        tables = [first]
        for _ in range(1, n):
            self.share(first[:full])
            tables.append(first[:full] + self.allocate(total - full))
        return tables, len(found) * size

    @property
    def available(self) -> int:
        return len(self.free) + int(np.count_nonzero(self.cached & (self.refs == 1)))

    def allocate(self, count: int) -> list[int]:
        if count > self.available:
            raise CacheFull(
                f"the KV cache needs {count} more pages of {self.page_size} tokens and has "
                f"{self.available} free: raise num_pages or lower max_slots / max_tokens"
            )
        while len(self.free) < count:
            self._evict_one()
        pages = [self.free.pop() for _ in range(count)]
        self.refs[pages] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        self.refs[pages] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def cached_prefix(self, keys: list[str]) -> list[int]:
        """The pages of the longest cached prefix among `keys` (one per full page)."""
        pages = []
        for key in keys:
            page = self.prefixes.get(key)
            if page is None:
                break
            pages.append(page)
        self._touch(keys[: len(pages)])
        return pages

    def remember(self, keys: list[str], pages: list[int]) -> None:
        """Keep these full pages as a cached prefix (one reference of their own)."""
        for key, page in zip(keys, pages):
            if key not in self.prefixes:
                self.prefixes[key] = page
                self.refs[page] += 1
                self.cached[page] = True
        self._touch(keys[: len(pages)])

    def forget_prefixes(self) -> None:
        """Drop every cached prefix (the cache's reference to each page): their keys and
        values belong to parameters that are no longer the engine's."""
        cached, self.prefixes = list(self.prefixes.values()), {}
        self.cached[:] = False
        self.release(cached)

    def _touch(self, keys: list[str]) -> None:
        """These prefix pages were just used: most recent now, a prefix's first page last."""
        for key in reversed(keys):
            self.prefixes[key] = self.prefixes.pop(key)

    def _evict_one(self) -> None:
        for key, page in self.prefixes.items():
            if self.refs[page] == 1:  # only the cache holds it
                del self.prefixes[key]
                self.cached[page] = False
                self.release([page])
                return
        raise CacheFull("no free page and no unused cached prefix to evict")

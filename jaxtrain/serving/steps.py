"""The engine's compiled steps: prefill (a chunk of several prompts, and the first token of
each sample whose prompt it finished), decode (one token for every active row) and a page copy.
Pure functions of arrays: the model's parameters and the page pool are arguments (the pool
donated), so live parameters change nothing that is compiled, and each step compiles once
per bucketed shape: rows, prompt tokens and page-table width (`Steps.compiles` records them;
`Engine.warm_up` compiles them all before the first request).

The parameters travel flattened (`flat_params`: their tree's structure, a static argument,
and the list of their arrays): an NNX State is flattened in Python at every call, 0.3-0.5 ms
for a 22-layer model, where a list of arrays takes microseconds. On the CPU the list holds
the projection kernels as [out, in] matrices (decode_weights.py). The host arrays of a call go
in as numpy arrays: jit places them with the call (0.06 ms for nine), where a `device_put`
of each took 0.6-0.8 ms on this CPU."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.kv_cache import decode_with_slots
from jaxtrain.serving.adapters import choose_adapters
from jaxtrain.serving.decode_weights import Flipped, kernel_views, stored_arrays
from jaxtrain.serving.paged import PagedSlots, decode_row_group, routing_of
from jaxtrain.serving.sampling import Drawn, sample_rows

__all__ = [
    "FlatParams",
    "Steps",
    "bucket",
    "buckets",
    "chunk_tokens",
    "flat_params",
    "smallest_table",
    "table_width",
]

Array = jax.Array
# ((the tree's structure, its flipped kernels' views), its arrays): flat_params
FlatParams = tuple[Any, list[Array]]
SMALLEST_PREFILL = 16
# The narrowest page table a step reads: 8 pages, or 128 tokens' worth of bigger pages (pages
# of 128: one, not 1,024 tokens). A step's table is as wide as the longest of its sequences needs
# (a bucket of this), so attention reads the pages in use, not max_length's: a short chat on a
# model with an 8k context reads 128 tokens, not 8k.
SMALLEST_TABLE, SMALLEST_TABLE_TOKENS = 8, 128
# A prefill's buckets of tokens and of pages are x4 apart (rows and decode steps' buckets x2):
# every shape is compiled at start-up (warm_up.py), and a prefill's three sizes multiply (a 1k
# context and 8 slots: 49 shapes, against 88 with every size x2 apart). Decode steps keep x2:
# they run at every token, and attention reads every page of their table.
PREFILL_GROWTH = 4


def bucket(n: int, smallest: int, largest: int, factor: int = 2) -> int:
    """The smallest of `smallest` * factor^k holding `n` (at most `largest`)."""
    size = smallest
    while size < n:
        size *= factor
    return min(size, largest)


def buckets(smallest: int, largest: int, factor: int = 2) -> list[int]:
    """Every value `bucket(n, smallest, largest, factor)` can take, ascending."""
    sizes = [smallest]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * factor)
    return sorted({min(s, largest) for s in sizes})


def smallest_table(page_size: int) -> int:
    """Columns of the narrowest page table of pages of `page_size` tokens."""
    return max(1, min(SMALLEST_TABLE, SMALLEST_TABLE_TOKENS // page_size))


def table_width(pages: int, max_pages: int, page_size: int, growth: int = 2) -> int:
    """Page-table columns of a step whose rows use up to `pages` pages."""
    return bucket(pages, smallest_table(page_size), max_pages, growth)


def chunk_tokens(tokens: int, budget: int) -> int:
    """Token columns of a prefill whose longest chunk has `tokens` tokens (`budget`: the
    engine's prefill_tokens)."""
    return bucket(tokens, SMALLEST_PREFILL, max(SMALLEST_PREFILL, budget), PREFILL_GROWTH)


def page_tables(tables: list[list[int]], rows: int, width: int) -> np.ndarray:
    """[rows, width] page tables: each sequence's first `width` pages (the ones it has
    written so far or writes now; it holds the rest for its later tokens); idle rows and
    columns past a sequence's pages are page 0, the garbage page."""
    out = np.zeros((rows, width), np.int32)
    for r, pages in enumerate(tables):
        out[r, : min(len(pages), width)] = pages[:width]
    return out


def flat_params(state: Any, flipped: Flipped = ()) -> FlatParams:
    """A model's state (an nnx.State) as a step's parameters: its structure and its arrays,
    the `flipped` kernels as [out, in] copies (decode_weights.py)."""
    structure, leaves, views = stored_arrays(state, flipped)
    return (structure, views), leaves


def adapter_rows(adapters: list[int], rows: int) -> np.ndarray:
    """[rows]: each sequence's LoRA adapter (0, none, for idle rows)."""
    return np.asarray(list(adapters) + [0] * (rows - len(adapters)), np.int32)


class StepPrograms:
    """The jitted steps of one model graph on pages of `page_size` tokens: functions of
    their arguments and of these settings only, so engines of the same graph and settings
    share them (`step_programs`) and a second engine compiles nothing the first did."""

    def __init__(
        self,
        graphdef: Any,
        page_size: int,
        pool_sharding: Any,
        kernel: str,
        processed_logprobs: bool,
        decode_steps: int,
    ):
        # Every step returns the pool with the sharding it came in with: a pool whose
        # placement changed would compile each step a second time.
        self.graphdef, self.page_size, self.pool_sharding = graphdef, page_size, pool_sharding
        self.kernel = kernel  # how decode steps attend: PagedSlots.kernel
        self.row_group = decode_row_group(pool_sharding)  # and how many rows at once
        self.processed = processed_logprobs  # log-probs after temperature (sampling.py)
        self.decode_steps = decode_steps  # tokens per sequence of a decode_many call
        # Each takes (structure, arrays, pool, ...): the structure static, the pool donated.
        jit = functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
        self.prefill = jit(self._prefill_fn)
        self.prefill_images = jit(self._prefill_images_fn)
        self.decode = jit(self._decode_fn)
        self.decode_many = jit(self._decode_many_fn)
        self.verify = jit(self._verify_fn)
        self.routing = jax.jit(routing_of)
        self.copy = jax.jit(
            lambda pool, source, target: self._placed(_copy_page(pool, source, target)),
            donate_argnums=0,
        )

    def _forward(
        self, structure, leaves, pool, ids, start, table, adapters, pad=None, every=False,
        pixel_values=None,
    ):  # fmt: skip
        structure, views = structure
        leaves = kernel_views(leaves, views)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(structure, leaves))
        choose_adapters(model, adapters)  # each row's LoRA adapter (serving/adapters.py)
        slots = PagedSlots.of(
            start, ids.shape[1], table, self.page_size, pad, self.kernel, self.row_group
        )
        logits, pool = decode_with_slots(
            model, ids, slots, pool, every=every, pixel_values=pixel_values
        )
        return logits, self._placed(pool)

    def _placed(self, pool: Any) -> Any:
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.pool_sharding), pool)

    def _prefill_fn(
        self, structure, leaves, pool, ids, start, table, pad, adapters, rows, positions, *sampling
    ):
        logits, pool = self._forward(structure, leaves, pool, ids, start, table, adapters, pad)
        return sample_rows(logits[rows], *sampling, positions, self.processed), pool

    def _prefill_images_fn(
        self, structure, leaves, pool, ids, start, table, pad, adapters, rows, positions, pixel_values,
        *sampling,
    ):  # fmt: skip
        logits, pool = self._forward(
            structure, leaves, pool, ids, start, table, adapters, pad, False, pixel_values
        )
        return sample_rows(logits[rows], *sampling, positions, self.processed), pool

    def _decode_fn(self, structure, leaves, pool, ids, start, table, adapters, *sampling):
        logits, pool = self._forward(structure, leaves, pool, ids, start, table, adapters)
        return sample_rows(logits, *sampling, start + 1, self.processed), pool

    def _decode_many_fn(
        self, structure, leaves, pool, ids, start, table, adapters, limit, *sampling
    ):
        def one(carry, i):
            pool, ids = carry
            # A row past its `limit` (its last token drawn) writes to the garbage page only.
            live = jnp.where((i < limit)[:, None], table, 0)
            logits, pool = self._forward(structure, leaves, pool, ids, start + i, live, adapters)
            drawn = sample_rows(logits, *sampling, start + i + 1, self.processed)
            return (pool, drawn.tokens[:, None]), drawn

        steps = jnp.arange(self.decode_steps, dtype=jnp.int32)
        (pool, _), drawn = jax.lax.scan(one, (pool, ids), steps)
        return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), drawn), pool

    def _verify_fn(self, structure, leaves, pool, ids, start, table, adapters, drafted, *sampling):
        logits, pool = self._forward(
            structure, leaves, pool, ids, start, table, adapters, every=True
        )
        b, t, v = logits.shape
        positions = (start[:, None] + 1 + jnp.arange(t, dtype=jnp.int32)[None]).reshape(-1)
        rows = [jnp.repeat(a, t, axis=0) for a in sampling]
        drawn = sample_rows(logits.reshape(b * t, v), *rows, positions, self.processed)
        drawn = jax.tree.map(lambda x: x.reshape(b, t, *x.shape[1:]), drawn)
        # Draft token j is kept while it equals the token drawn after position j (and every
        # draft token before it was kept); then the first drawn token that differs.
        same = ids[:, 1:] == drawn.tokens[:, :-1]
        same &= jnp.arange(t - 1, dtype=jnp.int32)[None] < drafted[:, None]
        kept = jnp.cumprod(same.astype(jnp.int32), axis=1).sum(axis=1)
        return drawn, kept, pool


def step_programs(
    graphdef: Any, page_size: int, pool_sharding: Any, kernel: str, processed: bool,
    decode_steps: int,
) -> StepPrograms:  # fmt: skip
    """The programs of engines of this graph and settings: shared within the process, or the
    engine's own when the graph cannot be a key (a model attribute holding a dict or list)."""
    key = (graphdef, page_size, pool_sharding, kernel, processed, decode_steps)
    try:
        hash(key)
    except TypeError:
        return StepPrograms(*key)
    return _shared_step_programs(*key)


# A process may build engines of one model graph again: GRPO runs one after another in a
# notebook, a test suite's hundred small runs. The graph and these settings (with the
# parameters' structure, a static argument) key every program, so sharing them skips
# tracing, lowering and compiling every bucket again (tests/trainers/test_grpo.py: 75 -> 42
# s). Held for a few graphs; jax.clear_caches() empties the programs.
@functools.lru_cache(maxsize=8)
def _shared_step_programs(*key: Any) -> StepPrograms:
    return StepPrograms(*key)


class Steps:
    """One engine's steps: the shared `StepPrograms` of its graph, and the shapes this
    engine has called them with (`compiles`)."""

    def __init__(
        self,
        graphdef: Any,
        page_size: int,
        pool_sharding: Any,
        kernel: str = "gather",
        processed_logprobs: bool = False,
        decode_steps: int = 1,
        flipped: Flipped = (),
    ):
        self.flipped = flipped  # kernels the parameters hold as [out, in] (flat_params)
        self.programs = step_programs(
            graphdef, page_size, pool_sharding, kernel, processed_logprobs, decode_steps
        )
        self.compiles: dict[str, set[tuple]] = {
            "prefill": set(), "prefill_images": set(), "decode": set(), "decode_many": set(),
            "verify": set(),
        }  # fmt: skip

    @property
    def kernel(self) -> str:
        return self.programs.kernel

    def params(self, state: Any) -> FlatParams:
        """`state` as these steps take it (`flat_params`, this engine's kernels flipped)."""
        return flat_params(state, self.flipped)

    # ------------------------------------------------------------- calls
    def prefill(
        self, params: FlatParams, pool, ids, start, table, pad, adapters, rows, positions, *sampling
    ) -> tuple[Drawn, Any]:
        """Writes each row's chunk [R, T] (left-padded by `pad` [R] tokens, its first real
        token at position `start` [R], through its LoRA adapter `adapters` [R], 0: none)
        and draws S first tokens: sample s from the logits
        after row `rows[s]`'s last token (a prompt's n samples share its row), at position
        `positions[s]`, with the samples' `sampling_arrays` (rows of unfinished prompts are
        drawn and ignored: S is fixed, so the draw adds no shape to compile)."""
        self.compiles["prefill"].add((ids.shape, table.shape))
        return self.programs.prefill(
            *params, pool, ids, start, table, pad, adapters, rows, positions, *sampling
        )

    def prefill_images(
        self, params: FlatParams, pool, ids, start, table, pad, adapters, rows, positions,
        pixel_values, *sampling,
    ) -> tuple[Drawn, Any]:  # fmt: skip
        """`prefill` of a vision-language model's chunk that writes images' tokens: with the
        pixels [R, max_images, C, H, W] of those images, each row's in order
        (serving/images.py)."""
        self.compiles["prefill_images"].add((ids.shape, table.shape))
        return self.programs.prefill_images(
            *params, pool, ids, start, table, pad, adapters, rows, positions, pixel_values,
            *sampling,
        )  # fmt: skip

    def decode(
        self, params: FlatParams, pool, ids, start, table, adapters, *sampling
    ) -> tuple[Drawn, Any]:
        """Each row's next token and its log-probs from its last token [B, 1] at position
        `start` [B], through its adapter `adapters` [B]; `sampling`: the rows'
        `sampling_arrays`."""
        self.compiles["decode"].add((ids.shape, table.shape))
        return self.programs.decode(*params, pool, ids, start, table, adapters, *sampling)

    def decode_many(
        self, params: FlatParams, pool, ids, start, table, adapters, limit, *sampling
    ) -> tuple[Drawn, Any]:
        """`decode_steps` decode steps in one call, each row's draw fed back as its next
        token: draws [B, decode_steps] (Drawn's arrays with a step axis after the row's).
        Row b draws its first `limit[b]` tokens; after them it writes only to the garbage
        page (its later draws are read by no one). Each draw equals `decode`'s at its
        position: one call instead of decode_steps saves the host's work between steps."""
        self.compiles["decode_many"].add((ids.shape, table.shape))
        return self.programs.decode_many(
            *params, pool, ids, start, table, adapters, limit, *sampling
        )

    def verify(self, params: FlatParams, pool, ids, start, table, adapters, drafted, *sampling):
        """Each row's newest token and its draft [B, 1 + k] (the first `drafted` [B] draft
        tokens real) at positions from `start` [B]: the draw after every position [B, 1 + k]
        and how many draft tokens each row keeps [B] (speculation.py)."""
        self.compiles["verify"].add((ids.shape, table.shape))
        return self.programs.verify(*params, pool, ids, start, table, adapters, drafted, *sampling)

    def lower(self, kind: str, state: Any, pool: Any, *args: Any) -> Any:
        """The `kind` step (a name of `compiles`) lowered for these arguments
        (arrays, or jax.ShapeDtypeStructs), not run: what `jaxtrain plan` compiles."""
        shapes = jax.tree.map(  # a trainer may have donated the arrays: their shapes remain
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            state,
        )
        return getattr(self.programs, kind).lower(*self.params(shapes), pool, *args)

    def routing(self, pool: Any, pages: list[int], max_pages: int) -> np.ndarray:
        """[S, max_pages * page_size, k]: the experts a pool that records routing holds for
        the tokens of a sequence's `pages` (paged.routing_of), on the host."""
        table = np.zeros(max_pages, np.int32)  # one width: one compile
        table[: len(pages)] = pages
        return np.asarray(self.programs.routing(pool, table))

    def copy_page(self, pool: Any, source: int, target: int) -> Any:
        """`pool` with page `target` a copy of page `source` in every layer."""
        return self.programs.copy(pool, np.int32(source), np.int32(target))


def _copy_page(pool: Any, source: Array, target: Array) -> Any:
    return jax.tree.map(lambda x: x.at[:, target].set(x[:, source]), pool)

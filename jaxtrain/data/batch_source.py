"""What a step eats, owned in one place: the batch source protocol and the loaders' source.

A `BatchSource` gives the loop one global batch per step and knows three things about it:
- its abstract shapes (`abstract_batch()`: global ShapeDtypeStructs with their shardings),
  which is all that compiling the step needs (the Trainer, `jaxtrain plan`);
- the batches themselves (`next(step, state)`): this process's rows (`host`) and the batch
  assembled on the mesh from every process's rows (`batch`), plus logs of its own;
- its position, for an exact resume (`data_state` / `check_data_state`, saved in the
  checkpoint's metadata) and any arrays it must keep in the checkpoint
  (`checkpoint_extra` / `resume_extra`).

An offline source (`LoaderSource`: a train loader of jaxtrain.data) ignores the state and
reads ahead in a background thread. An on-policy source (GRPO's rollouts,
trainers/grpo_source.py) samples from the live parameters the loop hands it (`on_policy`):
its time is the step's, not a wait for data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np

from jaxtrain.data.meter import DataMeter
from jaxtrain.data.mixture import MixtureLoader
from jaxtrain.data.prefetch import Prefetcher, prefetch
from jaxtrain.parallel.batch import BatchLayout

__all__ = ["BatchSource", "DataExhausted", "LoaderSource", "SourceBatch", "abstract_of"]


class DataExhausted(Exception):
    """A finite source has no batch for this step (a mixture whose source ran out, with
    mixture_exhausted="stop"): the loop ends the run after the previous step."""


@dataclasses.dataclass
class SourceBatch:
    """One step's batch: this process's rows, the global batch on the mesh, extra logs."""

    host: dict[str, np.ndarray]
    batch: dict[str, jax.Array]
    logs: dict[str, float] = dataclasses.field(default_factory=dict)


class BatchSource(Protocol):
    """See the module docstring."""

    on_policy: bool  # next() samples from the state it is given
    state_is_per_process: bool  # each process knows only its own position (streams, packing)

    @property
    def steps_per_epoch(self) -> int: ...

    def epoch(self, step: int) -> float: ...

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]: ...

    def open(self, start_step: int, program: Any = None) -> None: ...

    def next(self, step: int, state: Any) -> SourceBatch: ...

    def close(self) -> None: ...

    def data_state(self, step: int) -> dict[str, Any]: ...

    def check_data_state(self, state: dict[str, Any]) -> int: ...

    def checkpoint_extra(self, step: int) -> tuple[dict[str, Any], Any] | None: ...

    def resume_extra(
        self, details: dict[str, Any], restore: Callable[[Any], Any], step: int
    ) -> None: ...


def abstract_of(batch: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and shardings of a global batch."""
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
        for k, v in batch.items()
    }


class LoaderSource:
    """A train loader's batches (jaxtrain.data.pipeline), each assembled on the mesh from
    every process's share, `prefetch_batches` ahead in a background thread; what collation
    cut or padded is counted by `meter`."""

    on_policy = False

    def __init__(
        self,
        loader: Any,
        layout: BatchLayout,
        *,
        prefetch_batches: int,
        meter: DataMeter | None = None,
    ):
        self.loader, self.layout = loader, layout
        self.prefetch_batches = prefetch_batches
        self.meter = meter or DataMeter()
        self.state_is_per_process = bool(getattr(loader, "state_is_per_process", False))
        self._prefetcher: Prefetcher | None = None
        self._batches: Iterator[tuple[Any, Any]] | None = None
        self._first: tuple[Any, Any] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.loader.steps_per_epoch

    def epoch(self, step: int) -> float:
        return self.loader.epoch(step)

    def data_state(self, step: int) -> dict[str, Any]:
        return self.loader.data_state(step)

    def check_data_state(self, state: dict[str, Any]) -> int:
        return self.loader.check_data_state(state)

    def open(self, start_step: int, program: Any = None) -> None:
        """Start reading at `start_step` (a resumed run's position)."""
        del program  # offline: the batches do not depend on the model
        self.close()
        layout = self.layout

        def placed():
            host_batches = self.loader.batches(start_step=start_step, with_stats=True)
            for host_batch, stats in host_batches:
                yield (host_batch, layout.to_global(host_batch, micro_axis=True)), stats

        self._prefetcher = prefetch(placed(), size=self.prefetch_batches)
        self._batches = self.meter.wrap(self._prefetcher)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes of the first batch from the open position (read now, kept for the
        first `next`): a loader's rows are shaped by its collator, known once one ran."""
        if self._batches is None:
            self.open(0)
        if self._first is None:
            try:
                self._first = next(self._batches)
            except StopIteration:
                raise DataExhausted("the train data has no batch left to train on") from None
        return abstract_of(self._first[1])

    @property
    def source_names(self) -> tuple[str, ...] | None:
        """A mixture's source names (the index of `source_ids` in its batches), else None."""
        return self.loader.names if isinstance(self.loader, MixtureLoader) else None

    def next(self, step: int, state: Any = None) -> SourceBatch:
        del state  # offline: the loader's order is a function of its position
        if self._first is not None:
            host, batch = self._first
            self._first = None
        else:
            try:
                host, batch = next(self._batches)
            except StopIteration:  # endless loaders never end; a finite mixture does
                raise DataExhausted(f"the train data has no batch for step {step + 1}") from None
        # What the loader says about its position after this step (a mixture: each
        # source's epochs and tokens), logged with the step.
        step_logs = getattr(self.loader, "step_logs", None)
        return SourceBatch(host, batch, step_logs(step + 1) if step_logs else {})

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()  # the train loader is endless: stop its reader
        self._prefetcher = self._batches = self._first = None

    def checkpoint_extra(self, step: int) -> None:
        return None  # the position in the metadata is all an offline source needs

    def resume_extra(self, details: dict[str, Any], restore: Callable, step: int) -> None:
        del details, restore, step


def eval_global_batches(loader: Any, layout: BatchLayout, prefetch_batches: int) -> Prefetcher:
    """An eval loader's batches assembled on the mesh (no micro-batch axis), read ahead.
    Returns the Prefetcher of (host batch, global batch) pairs: close() it when done early."""

    def placed():
        for host_batch in loader.batches():
            yield host_batch, layout.to_global(host_batch, micro_axis=False)

    return prefetch(placed(), size=prefetch_batches)

"""A weighted mixture of train sources: one loader whose batches mix rows of several sources.

    Trainer(dataset_train={"web": web, "code": Source(code, text_column="content")},
            arguments=TrainingArguments(mixture_weights={"web": 0.7, "code": 0.3}, ...))

Each source is read by the loader it would have alone (tokenized, rendered, packed,
streamed as any dataset_train: mixture_rows.py), one row per process at a time. Every step
the schedule (mixture_schedule.py) says which source fills each slot of the batch; a slot is
one row on every process (row c of micro-batch a on each), so the processes agree on the
sources of a step without talking. The batch carries `source_ids` [A, M] (the index of each
row's source in `names`), which the step turns into per-source sums (the loss and the share
of the step's tokens of each source, jaxtrain.training.mixture_objective).

The position after a step (the stage's slot counts, each source's row position and its
loader's own data_state, the tokens each source gave) is recorded for the last steps the
read-ahead produced, saved in the checkpoint (`data_state`) and restored (`check_data_state`):
a resumed run continues with exactly the rows an uninterrupted one would have read.

A source that runs out of rows restarts (its next epoch, differently shuffled) or, with
`mixture_exhausted="stop"`, ends the mixture: its batches stop before the first step that
would need a row of a source's second epoch.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, CollateStats
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.mixture_rows import RowReader, Taken
from jaxtrain.data.mixture_schedule import MixtureSchedule, Plan

__all__ = ["MixtureLoader", "Source", "source_seed"]

# Steps whose position the loader keeps beyond the read-ahead (prefetch_batches steps).
HISTORY = 8
# Steps the schedule is worked out for at a time (MixtureSchedule.plan).
PLAN_STEPS = 64
# Steps whose rows are read and put in slot order at once (MixtureLoader._block); a source
# reads this many steps ahead of the batch being made.
BLOCK_STEPS = 8


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of a mixture with settings of its own; None keeps the run's (the
    TrainingArguments field of the same name). `data` is any dataset_train input."""

    data: Any
    text_column: str | None = None
    messages_column: str | None = None
    completion_only_loss: bool | None = None
    chat_template: str | None = None
    ids_to_pop_from_dataset: list[str] | None = None
    streaming: bool | None = None

    def overrides(self) -> dict[str, Any]:
        """DataSettings fields this source sets."""
        names = {
            "text_column": "text_column",
            "messages_column": "messages_column",
            "completion_only_loss": "completion_only_loss",
            "chat_template": "chat_template",
            "streaming": "streaming",
        }
        out = {
            dst: getattr(self, src) for src, dst in names.items() if getattr(self, src) is not None
        }
        if self.ids_to_pop_from_dataset is not None:
            out["drop_columns"] = tuple(self.ids_to_pop_from_dataset)
        return out


def source_seed(seed: int, name: str) -> int:
    """The shuffle seed of source `name`: its own, so sources of the same size are not
    shuffled alike, and the same in every run with that seed."""
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class _Position:
    """Where the mixture stands after a step."""

    counts: tuple[int, ...]  # slots each source got in the current stage
    rows: tuple[int, ...]  # each source's row position
    tokens: tuple[int, ...]  # target tokens each source gave (this process)


class MixtureLoader:
    """Endless (or, with exhausted="stop", finite) batches mixing `readers` by `schedule`;
    the loader interface of jaxtrain.data.loader (batches, data_state, check_data_state)."""

    steps_per_epoch = None  # an epoch per source: a mixture needs max_steps

    def __init__(
        self,
        readers: Mapping[str, RowReader],
        schedule: MixtureSchedule,
        *,
        global_batch_size: int,
        accumulation_steps: int,
        process_index: int = 0,
        process_count: int = 1,
        exhausted: str = "restart",
        read_ahead: int = 2,
    ):
        self.names = tuple(readers)
        if schedule.names != self.names:
            raise ValueError(f"the schedule's sources {schedule.names} are not {self.names}")
        self.readers = [readers[name] for name in self.names]
        self.schedule, self.exhausted = schedule, exhausted
        self.global_batch_size, self.accumulation_steps = global_batch_size, accumulation_steps
        self.process_index, self.process_count = process_index, process_count
        micro = global_batch_size // accumulation_steps
        self.columns = micro // process_count  # rows of a micro-batch on each process
        self.slots = accumulation_steps * self.columns
        self.state_is_per_process = any(r.state_is_per_process for r in self.readers)
        self.history = read_ahead + HISTORY  # steps whose position is kept
        zeros = (0,) * len(self.names)
        self._start = _Position(zeros, zeros, zeros)
        self._positions: dict[int, _Position] = {0: self._start}
        self._plan: Plan | None = None

    # ------------------------------------------------------------ reading
    def batches(self, start_step: int = 0, *, with_stats: bool = False) -> Iterator[Any]:
        """Batches from `start_step` on (a position restored by check_data_state, or one
        seen earlier; otherwise the mixture is replayed from step 0, exact but slow)."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        step = start_step if start_step in self._positions else 0
        position = self._positions.get(step) or self._start
        for reader, row in zip(self.readers, position.rows):
            reader.open(row)
        self._plan = None  # worked out again from this run's own position
        while True:
            made, stopped = self._block(step, position)
            for batch, stats, position in made:
                step += 1
                self._positions[step] = position
                self._positions.pop(step - self.history, None)
                if step > start_step:
                    yield (batch, stats) if with_stats else batch
            if stopped:  # a source ran out and the mixture stops here
                return

    def _block(self, step: int, before: _Position) -> tuple[list[tuple[Any, ...]], bool]:
        """The batches of the next steps from `step`, each with its collate stats and the
        position after it, and whether the mixture stops after them (a source ran out)."""
        if self._plan is None or step not in self._plan:
            counts = self.schedule.counts_at_start(step, before.counts)
            self._plan = self.schedule.plan(step, counts, self.slots, PLAN_STEPS)
        plan, i = self._plan, step - self._plan.first
        end = min(i + BLOCK_STEPS, len(plan.counts))
        takes = plan.takes[i:end]
        taken: list[Taken | None] = []
        steps = end - i  # the steps made: all, or those before a source's second epoch
        for k, reader in enumerate(self.readers):
            counts = [row[k] for row in takes]
            if not any(counts):
                taken.append(None)
                continue
            got = reader.take_steps(counts)
            taken.append(got)
            if self.exhausted == "stop" and True in got.past_first_epoch:
                steps = min(steps, got.past_first_epoch.index(True))
        sources = plan.sources[i:end]
        fields = self._assemble(sources, [(k, t.rows) for k, t in enumerate(taken) if t])
        # Target tokens of each source in each step, counted over all the steps at once.
        labels = fields["labels"]
        targets = np.count_nonzero(labels[..., 1:] != IGNORE_INDEX, axis=-1).reshape(-1)
        cells = (np.arange(len(sources))[:, None] * len(taken) + sources).reshape(-1)
        given = np.bincount(cells, targets, len(sources) * len(taken)).astype(np.int64)
        given = given.reshape(len(sources), len(taken)).tolist()
        made = []
        tokens, rows = list(before.tokens), list(before.rows)
        for j in range(steps):
            stats = None
            for k, t in enumerate(taken):
                if t is not None:
                    stats = merge_stats(stats, t.stats[j])
                    tokens[k] += given[j][k]
                    rows[k] = t.positions[j]
            batch = {key: value[j] for key, value in fields.items()}
            made.append((batch, stats, _Position(plan.counts[i + j], tuple(rows), tuple(tokens))))
        return made, steps < end - i

    def _assemble(
        self, sources: np.ndarray, parts: list[tuple[int, dict[str, np.ndarray]]]
    ) -> dict[str, np.ndarray]:
        """[steps, A, m, ...] rows of `sources` [steps, slots] in slot order, with
        `source_ids`. Each source's rows come step by step; concatenated source by source,
        slot s of the steps (flattened) takes the row at its place in a stable sort of the
        slots by source. One concatenation and one gather per field for all the steps: at a
        few rows a step, numpy's cost per call outweighs the copies."""
        first, keys = parts[0][0], parts[0][1].keys()
        for k, rows in parts[1:]:
            if rows.keys() != keys:
                raise DatasetError(
                    f"dataset_train[{self.names[k]!r}] rows have the fields {sorted(rows)} but "
                    f"dataset_train[{self.names[first]!r}] rows have {sorted(keys)}; the sources "
                    "of a mixture must give rows of the same kind (the same collator and packing)"
                )
        flat = sources.reshape(-1)
        gather = np.empty(len(flat), np.intp)
        gather[np.argsort(flat, kind="stable")] = np.arange(len(flat))
        shape = (len(sources), self.accumulation_steps, self.columns)
        out = {}
        for key in sorted(keys):
            fields = [rows[key] for _, rows in parts]
            joined = fields[0] if len(fields) == 1 else np.concatenate(fields)
            rows = joined.take(gather, axis=0)
            out[key] = rows.reshape(shape + rows.shape[1:])
        out["source_ids"] = sources.reshape(shape).copy()
        return out

    # ------------------------------------------------------------ position
    def epoch(self, step: int) -> float:
        """The epochs of the most repeated source after `step` steps."""
        return max(self.source_epochs(step).values(), default=0.0)

    def source_epochs(self, step: int) -> dict[str, float]:
        position = self._positions.get(step)
        if position is None:
            return {}
        return {
            name: reader.epoch(row)
            for name, reader, row in zip(self.names, self.readers, position.rows)
        }

    def step_logs(self, step: int) -> dict[str, float]:
        """Per source after `step` steps: its epochs and the target tokens it gave (this
        process's rows, times the processes: every process holds as many rows)."""
        position = self._positions.get(step)
        if position is None:
            return {}
        logs = {}
        epochs = self.source_epochs(step)
        for k, name in enumerate(self.names):
            logs[f"mixture/{name}/epoch"] = round(epochs[name], 4)
            logs[f"mixture/{name}/tokens"] = float(position.tokens[k] * self.process_count)
        return logs

    def _describe(self) -> dict[str, Any]:
        stages = [[start, dict(zip(self.names, w.tolist()))]
                  for start, w in zip(self.schedule.starts, self.schedule.weights)]  # fmt: skip
        return {
            "kind": "mixture",
            "sources": list(self.names),
            "stages": stages,
            "exhausted": self.exhausted,
            "global_batch_size": self.global_batch_size,
            "accumulation_steps": self.accumulation_steps,
        }

    def data_state(self, step: int) -> dict[str, Any]:
        """JSON-able position after `step` steps (one of the last `history` steps)."""
        position = self._positions.get(step)
        if position is None:
            raise ValueError(
                f"the mixture's position after step {step} is not known (only the last "
                f"{self.history} steps it produced are kept)"
            )
        return {
            **self._describe(),
            "step": int(step),
            "counts": list(position.counts),
            "rows": list(position.rows),
            "tokens": list(position.tokens),
            "positions": {
                name: reader.data_state(row)
                for name, reader, row in zip(self.names, self.readers, position.rows)
            },
        }

    def check_data_state(self, state: dict[str, Any]) -> int:
        """Validate a saved position against this mixture and resume from it."""
        if "processes" in state:  # a multi-process checkpoint: this process's entry
            if len(state["processes"]) != self.process_count:
                raise DatasetError(
                    f"The checkpoint's data position was saved by {len(state['processes'])} "
                    f"processes, this run has {self.process_count}; resume with as many"
                )
            state = state["processes"][self.process_index]
        mine = self._describe()
        differing = [key for key in mine if state.get(key) != mine[key]]
        if differing:
            details = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in differing)
            raise DatasetError(
                f"The checkpoint's data position does not fit this mixture ({details}). Resume "
                "with the same sources, mixture_weights and batch size, or start a new run "
                "(another output_dir, or overwrite_output_dir=True)."
            )
        rows = []
        for name, reader in zip(self.names, self.readers):
            rows.append(reader.check_data_state(state["positions"][name]))
        if rows != list(state["rows"]):
            raise DatasetError(
                f"The checkpoint's mixture position is inconsistent (rows {state['rows']} but "
                f"the sources' positions say {rows}); the checkpoint was not written by this "
                "version of the mixture."
            )
        step = int(state["step"])
        self._positions[step] = _Position(
            tuple(state["counts"]), tuple(rows), tuple(int(t) for t in state["tokens"])
        )
        return step


def merge_stats(a: CollateStats | None, b: CollateStats | None) -> CollateStats | None:
    """Collate stats of two parts of a batch (None: a user collator's, not counted)."""
    if a is None:
        return b
    return a if b is None else a + b

"""One run's checkpoints: where it starts, its saves, keep-N, and closing them.

Where a run starts is decided once, in this order (the first that applies wins):

1. `resume_from` names a checkpoint: resume from it (it must exist; an output_dir that
   already holds checkpoints of its own is refused, so two runs never mix, unless
   `overwrite_output_dir` deletes them first: the checkpoint is then another run's).
2. `overwrite_output_dir`: start fresh, deleting output_dir's old checkpoints.
3. `resume_if_possible` and output_dir holds a committed checkpoint: resume from the newest.
4. Otherwise start fresh; an output_dir with committed checkpoints is refused.

A resume that cannot happen (another model, optimizer or data; damaged files) is an error
that says what differs and how to go on; a run never falls back to a fresh start on its own.

`RunCheckpoints` takes what it needs as arguments and returns plain values (`StartPlan`,
`RunStart`); it knows nothing of the Trainer. Deciding (`plan`) and building the state
(`load`) are apart so that the train step can compile while the state is built or restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.checkpointing import compat
from jaxtrain.checkpointing import files as ckpt
from jaxtrain.checkpointing.checksums import verify_checksums, write_checksums
from jaxtrain.checkpointing.files import CheckpointError
from jaxtrain.checkpointing.quiet import quiet_orbax
from jaxtrain.config.sections import CheckpointSettings
from jaxtrain.state import TrainState

logger = logging.getLogger("jaxtrain")


@dataclasses.dataclass
class StartPlan:
    """Where a run starts, decided and checked before any array of its state exists."""

    step: int
    # The step directory to resume from, or None for a fresh start.
    resumed_from: Path | None = None
    # What the trackers saved in that checkpoint (TensorBoard dir, W&B run id, run name).
    tracker_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Whether the resumed run had evaluated at `step` before saving it (a rerun of a
    # finished run must not log that evaluation twice).
    evaluated: bool = False
    # The JSON details of the arrays a task trainer saved beside the state (its `extra`
    # item, e.g. GRPO's generated batch inside a round), or None when it saved none.
    extra: dict[str, Any] | None = None
    # The arguments the checkpoint was written under (its metadata's), None on a fresh start.
    saved_arguments: dict[str, Any] | None = None
    # What the run says after where it resumed from (a schedule the arguments changed).
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunStart(StartPlan):
    """Where a run starts, with its state built (fresh) or restored (resume)."""

    state: TrainState | None = None


class RunCheckpoints:
    """The checkpoints of the run writing into `output_dir`.

    `plan(...)` decides where the run starts, `load(plan, ...)` builds or restores its state,
    `save(...)` writes a checkpoint in the
    background (keeping the newest `max_to_keep`), `close()` waits for the writes to commit.
    """

    def __init__(self, settings: CheckpointSettings):
        self.settings = settings
        self.root = ckpt.checkpoints_root(self.settings.output_dir)
        self._saver: _Saver | None = None  # opened at the first save of a run

    # ------------------------------------------------------------------ start
    def plan(
        self,
        *,
        model_class: str,
        model_config: dict[str, Any] | None,
        check_data_state: Callable[[dict[str, Any]], int] | None = None,
        trainer_name: str | None = None,
    ) -> StartPlan:
        """Where the run starts (see the module docstring for the order), without its state.

        A fresh start clears output_dir's leftovers; a resume checks the checkpoint's files,
        that it was written by this trainer (`trainer_name`), for this model (`model_class`,
        `model_config`) and optimizer, and
        that its data position (`check_data_state` returns the step a saved position belongs
        to) matches its step. Everything that can refuse a resume is checked here, before
        anything is compiled or restored.
        """
        settings = self.settings
        path = compat.resume_checkpoint(settings)
        if path is None:
            self._clear_output_dir()
            return StartPlan(step=0)
        if path.parent != self.root and ckpt.committed_steps(self.root):
            if not settings.overwrite_output_dir:
                raise CheckpointError(
                    f"resume_from={settings.resume_from} is another run's checkpoint, but "
                    f"output_dir {settings.output_dir} already holds checkpoints of its own. "
                    "Choose a new output_dir for the resumed run, or pass "
                    "--overwrite_output_dir true to delete them first."
                )
            self._clear_output_dir()  # the checkpoint is elsewhere (config/checks.py)
        metadata = read_verified(path)
        compat.check_compatible(
            metadata,
            path=path,
            model_class=model_class,
            model_config=model_config,
            optimizer=settings.optimizer,
            reset_optimizer=settings.reset_optimizer,
            trainer_name=trainer_name,
        )
        step = int(metadata["step"])
        if "data_state" in metadata and check_data_state is not None:
            data_step = check_data_state(metadata["data_state"])
            if data_step != step:
                raise CheckpointError(
                    f"{path}: its data position (step {data_step}) does not match its train "
                    f"state (step {step}); the checkpoint is inconsistent. Resume from another."
                )
        # The metric log continues from the checkpoint (before the log is opened for it).
        Path(settings.output_dir).mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            compat.trim_metric_log(Path(settings.output_dir) / "metrics.jsonl", step)
        _barrier("jaxtrain_resume")
        return StartPlan(
            step=step,
            resumed_from=path,
            tracker_state=metadata.get("trackers") or {},
            evaluated=bool(metadata.get("evaluated", False)),
            extra=metadata.get("extra"),
            saved_arguments=metadata.get("arguments"),
        )

    def _clear_output_dir(self) -> None:
        """A fresh output_dir: leftovers cleared; old checkpoints deleted with
        overwrite_output_dir, else refused. One process clears while the others wait; a
        refusal raises everywhere."""
        settings = self.settings
        refused = bool(ckpt.committed_steps(self.root)) and not settings.overwrite_output_dir
        if jax.process_index() == 0 or refused:
            ckpt.prepare_output_dir(settings.output_dir, overwrite=settings.overwrite_output_dir)
            (Path(settings.output_dir) / "metrics.jsonl").unlink(missing_ok=True)
        _barrier("jaxtrain_prepare_output_dir")

    def load(
        self,
        plan: StartPlan,
        *,
        fresh_state: Callable[[], TrainState],
        abstract_state: Callable[[], TrainState],
        init_optimizer: Callable[[Any], Any],
    ) -> RunStart:
        """`plan` with its state: `fresh_state()`, or the checkpoint restored onto
        `abstract_state()` (its shardings); with `reset_optimizer`, only the parameters,
        with a new optimizer state from `init_optimizer(params)`."""
        settings, path = self.settings, plan.resumed_from
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(StartPlan)}
        if path is None:
            return RunStart(**fields, state=fresh_state())
        abstract = abstract_state()
        if settings.reset_optimizer:
            params = ckpt.restore_params(path, abstract.params)
            opt_state = jax.jit(init_optimizer)(params)
            step = jnp.asarray(plan.step, jnp.int32)
            state = TrainState(step=step, params=params, opt_state=opt_state)
        else:
            state = ckpt.restore_state(path, abstract)
        return RunStart(**fields, state=state)

    # ------------------------------------------------------------------ saves
    def save(self, state: TrainState, *, metadata: dict[str, Any], extra: Any = None) -> Path:
        """Start a background save of `state` with `metadata` (JSON) and `extra` (a pytree of
        arrays kept beside the state, or None); returns the step directory they commit to,
        together. The save before it is committed first."""
        if self._saver is None:
            self._saver = _Saver(self.root, max_to_keep=self.settings.save_total_limit)
        return self._saver.save(state, metadata=metadata, extra=extra)

    def wait(self) -> None:
        """Block until every save started so far is committed."""
        if self._saver is not None:
            self._saver.wait()

    def close(self) -> None:
        """Wait for the background writes to commit; a later save opens a new writer."""
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.close()


def load_checked(
    path: str | Path,
    abstract: TrainState,
    *,
    model_class: str,
    model_config: dict[str, Any] | None,
    optimizer: str,
    trainer_name: str | None = None,
) -> TrainState:
    """The TrainState at `path` (a step, checkpoints or run directory) restored onto
    `abstract`, after checking it was written for this model and optimizer."""
    step_dir = ckpt.find_checkpoint(path)
    metadata = read_verified(step_dir)
    compat.check_compatible(
        metadata,
        path=step_dir,
        model_class=model_class,
        model_config=model_config,
        optimizer=optimizer,
        reset_optimizer=False,
        loading=True,
        trainer_name=trainer_name,
    )
    return ckpt.restore_state(step_dir, abstract)


def read_verified(step_dir: Path) -> dict[str, Any]:
    """The metadata of `step_dir` once every file it committed matches its checksum (a
    damaged checkpoint is refused before anything is restored or compiled)."""
    verify_checksums(step_dir)
    return ckpt.read_metadata(step_dir)


_DELETING = ".jaxtrain-deleting"  # suffix of an old checkpoint being deleted (keep-N)


class _Saver:
    """Orbax's CheckpointManager writing `<root>/<step>/{state,meta[,extra]}`, keeping the
    newest K.

    Saves are asynchronous (the loop keeps stepping while bytes go to disk) and Orbax commits
    a step directory atomically (written as `<step>.orbax-checkpoint-tmp-*`, then renamed).
    A write that fails (a full disk, lost permissions) surfaces at the next save, wait or
    close as a CheckpointError naming the step directory; its temporary directory is
    removed and the checkpoints committed before it stay as they were (keep-N deletes old
    checkpoints only after a new one commits).
    """

    def __init__(self, root: Path, *, max_to_keep: int | None = None):
        import orbax.checkpoint as ocp

        self.root = root
        self._saving: int | None = None  # the step whose background write is in flight
        self._failed = False
        self.max_to_keep = max_to_keep
        # Keep-N is done here, not by Orbax: Orbax deletes an old step directory in place, so
        # a kill -9 during that delete leaves a half-deleted directory under a step's name.
        # `_prune` renames it away first (atomic), then deletes.
        if jax.process_index() == 0:
            for leftover in root.glob(f"*{_DELETING}"):
                shutil.rmtree(leftover, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,
            enable_async_checkpointing=True,
            create=True,
            # Partial saves of a killed run are removed when the next run opens the directory.
            cleanup_tmp_directories=True,
            # Runs in Orbax's background thread after the files are finalized and before
            # the step directory is renamed into place: the checksums are part of the commit.
            async_options=ocp.AsyncOptions(post_finalization_callback=self._before_commit),
        )
        with self._failures():
            self._manager = ocp.CheckpointManager(root, options=options)
        quiet_orbax()

    def save(self, state: TrainState, *, metadata: dict[str, Any], extra: Any = None) -> Path:
        import orbax.checkpoint as ocp

        step = int(jax.device_get(state.step))
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(metadata)}
        if extra is not None:  # one more item of the same step: committed with the rest
            items["extra"] = ocp.args.StandardSave(extra)
        with self._failures():
            self._manager.wait_until_finished()  # Orbax would wait too; _saving is one step
            self._prune()
            self._saving = step
            self._manager.save(step, args=ocp.args.Composite(**items))
        return self.root / str(step)

    def _prune(self) -> None:
        """Delete all but the newest `max_to_keep` committed checkpoints (all committed now)."""
        if self.max_to_keep is None or jax.process_index() != 0:
            return
        for step in ckpt.committed_steps(self.root)[: -self.max_to_keep]:
            doomed = self.root / f"{step}{_DELETING}"
            (self.root / str(step)).rename(doomed)  # no longer a step name, then removed
            shutil.rmtree(doomed)

    def _before_commit(self) -> None:
        if jax.process_index() != 0 or self._saving is None:
            return
        # Where Orbax commits by writing a marker file instead of renaming, the step
        # directory already has its final name.
        pending = self._temporary_dirs(self._saving)
        write_checksums(pending[-1] if pending else self.root / str(self._saving))

    def _temporary_dirs(self, step: int) -> list[Path]:
        found = self.root.glob(f"{step}.orbax-checkpoint-tmp*")
        return sorted(found, key=lambda p: p.stat().st_mtime)

    @contextlib.contextmanager
    def _failures(self):
        """Turn a failed write into a CheckpointError naming the step directory and cause."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:  # re-raised with the path and what to do; never ignored
            self._failed = True
            step = self._saving
            target = self.root / str(step) if step is not None else self.root
            self._remove_uncommitted()
            text = f"{type(err).__name__}: {err}"
            full = "No space left on device" in text or getattr(err, "errno", None) == 28
            cause = "the disk is full" if full else "the write failed"
            committed = ckpt.committed_steps(self.root)
            kept = (
                f"The last committed checkpoint, {self.root / str(committed[-1])}, is intact."
                if committed
                else "No checkpoint of this run was committed."
            )
            raise CheckpointError(
                f"Could not save checkpoint {target}: {cause} ({text.splitlines()[0][:300]}). "
                f"Its partial files were removed. {kept} Free space (or fix the cause) and "
                "run the same command again to resume."
            ) from err

    def _remove_uncommitted(self, patience_s: float = 0.0, quiet_s: float = 1.0) -> None:
        """Every uncommitted directory, not only this step's: an async write's failure can
        surface at the next save, after its own step's directory was made. With patience,
        removed again until none has reappeared for `quiet_s`, for up to `patience_s`, then
        the directories left are named: Orbax's commit thread ends at the first failed
        write while the others still run, and a write still running recreates its
        directory after a removal (a loaded machine left one behind, three times)."""
        if jax.process_index() != 0:
            return
        deadline = time.monotonic() + patience_s
        quiet_since = time.monotonic()
        while True:
            left = sorted(self.root.glob("*.orbax-checkpoint-tmp*"))
            for leftover in left:
                shutil.rmtree(leftover, ignore_errors=True)  # what is left is checked below
            now = time.monotonic()
            if left:
                quiet_since = now
            if now >= deadline or (not left and now - quiet_since >= quiet_s):
                break
            time.sleep(0.05)
        left = sorted(self.root.glob("*.orbax-checkpoint-tmp*"))
        if left:
            logger.warning(
                "jaxtrain: could not remove the partial checkpoint directories %s; they are "
                "not checkpoints (a resume ignores them): delete them.",
                ", ".join(map(str, left)),
            )

    def wait(self) -> None:
        with self._failures():
            self._manager.wait_until_finished()

    def close(self) -> None:
        with self._failures():
            try:
                if not self._failed:  # a failure already raised: do not wait on it twice
                    self._manager.wait_until_finished()
                    self._prune()
            finally:
                try:
                    # After a failed save this raises its error again (Orbax's async
                    # checkpointer re-checks it on close): the removal below must still run.
                    self._manager.close()
                finally:
                    if self._failed:
                        # Writes of the failed save still in flight when it was cleaned up
                        # (a loaded machine left a directory behind) end now or soon.
                        self._remove_uncommitted(patience_s=10.0)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)

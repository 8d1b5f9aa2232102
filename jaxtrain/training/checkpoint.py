"""Orbax checkpoints of the train state, with the run's arguments and model config beside it.

Saves are asynchronous (the loop keeps stepping while bytes go to disk) and Orbax commits a
step directory atomically. Nothing is pickled: arrays are tensorstore files, metadata JSON.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax

from jaxtrain.errors import CheckpointError
from jaxtrain.training.state import TrainState

# orbax is imported where it is used: it is not needed before the first save.


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir).absolute() / "checkpoints"


def committed_steps(root: str | Path) -> list[int]:
    """Steps under a checkpoints directory whose save was committed, oldest first.

    Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames to `<step>` only once every
    file is on disk, so a bare integer name means a complete checkpoint; a save killed
    half-way leaves only a tmp directory, which nothing here ever reads.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def find_checkpoint(path: str | Path) -> Path:
    """A step directory from a step directory, a checkpoints directory or a run directory
    (the newest committed step of the latter two)."""
    path = Path(path).absolute()
    if (path / "state").is_dir():
        return path
    for root in (path, checkpoints_root(path)):
        steps = committed_steps(root)
        if steps:
            return root / str(steps[-1])
    raise CheckpointError(
        f"No committed checkpoint at {path}. Pass a step directory such as "
        "<output_dir>/checkpoints/<step>, or a run directory that has checkpoints."
    )


def prepare_output_dir(output_dir: str | Path, *, overwrite: bool) -> None:
    """Make `output_dir` ready for a fresh run: refuse to mix it with an old run's committed
    checkpoints unless told to replace them; clear leftovers of interrupted saves."""
    root = checkpoints_root(output_dir)
    steps = committed_steps(root)
    if steps and not overwrite:
        raise CheckpointError(
            f"{root} already holds checkpoints (steps {', '.join(map(str, steps[-5:]))}) but "
            "this run does not resume them (resume_if_possible=False). Pass "
            "--resume_if_possible true to continue that run, choose a new output_dir, or pass "
            "--overwrite_output_dir true to delete them and start over."
        )
    if root.is_dir():
        shutil.rmtree(root)
    Path(output_dir).mkdir(parents=True, exist_ok=True)


class Checkpointer:
    """Writes `checkpoints/<step>/{state,meta}` under output_dir, keeping the newest K."""

    def __init__(self, output_dir: str | Path, *, max_to_keep: int | None = None):
        import orbax.checkpoint as ocp

        self.root = checkpoints_root(output_dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=True,
            create=True,
            # Partial saves of a killed run are removed when the next run opens the directory.
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.root, options=options)

    def save(self, state: TrainState, *, metadata: dict[str, Any]) -> Path:
        """Start a background save of `state`; returns the step directory it commits to."""
        import orbax.checkpoint as ocp

        step = int(jax.device_get(state.step))
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(metadata)
            ),
        )
        return self.root / str(step)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def restore_state(path: str | Path, abstract_state: TrainState) -> TrainState:
    """Read the train state saved in the step directory `path` onto `abstract_state`'s layout.

    `abstract_state` is a TrainState of arrays or jax.ShapeDtypeStruct (with shardings) that
    fixes the structure, shapes and placement to restore into.
    """
    import orbax.checkpoint as ocp

    state_dir = Path(path).absolute() / "state"
    if not state_dir.is_dir():
        raise CheckpointError(
            f"{path} is not a jaxtrain checkpoint step directory (no 'state' folder). "
            "Pass a directory like <output_dir>/checkpoints/<step>."
        )
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    try:
        with ocp.StandardCheckpointer() as checkpointer:  # closed: no stray async threads
            return checkpointer.restore(state_dir, target)
    except Exception as err:  # re-raised with the path and what to do; never ignored
        raise CheckpointError(
            f"Could not restore the train state from {state_dir}: {type(err).__name__}: "
            f"{err}. Either its files are damaged, or it was written for another model or "
            "optimizer configuration. Delete that step directory to resume from the previous "
            "checkpoint, pass --reset_optimizer true if only the optimizer changed, or start "
            "a new run in a new output_dir."
        ) from err


def restore_params(path: str | Path, abstract_params: Any) -> Any:
    """Only the parameters of the checkpoint at `path` (the optimizer state is not read)."""
    import orbax.checkpoint as ocp

    state_dir = Path(path).absolute() / "state"
    target = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=getattr(x, "sharding", None) or default), target
    )
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(
                state_dir,
                args=ocp.args.PyTreeRestore(
                    item=target, restore_args=restore_args, partial_restore=True
                ),
            )
    except Exception as err:  # re-raised with the path and what to do; never ignored
        raise CheckpointError(
            f"Could not restore the parameters from {state_dir}: {type(err).__name__}: {err}. "
            "The checkpoint's files are damaged or it belongs to another model."
        ) from err
    return restored["params"]


def read_metadata(path: str | Path) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    meta_dir = Path(path).absolute() / "meta"
    if not meta_dir.is_dir():
        raise CheckpointError(f"{path} has no 'meta' folder; is it a jaxtrain checkpoint?")
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
        return checkpointer.restore(meta_dir)

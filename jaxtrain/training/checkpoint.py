"""Orbax checkpoints of the train state, with the run's arguments and model config beside it.

Saves are asynchronous (the loop keeps stepping while bytes go to disk) and Orbax commits a
step directory atomically. Nothing is pickled: arrays are tensorstore files, metadata JSON.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax

from jaxtrain.training.state import TrainState

# orbax is imported where it is used: it is not needed before the first save.


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written where asked, or cannot be read back."""


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir).absolute() / "checkpoints"


def prepare_output_dir(output_dir: str | Path, *, overwrite: bool) -> None:
    """Refuse to mix a new run with an old run's checkpoints unless told to replace them."""
    root = checkpoints_root(output_dir)
    existing = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if existing and not overwrite:
        raise CheckpointError(
            f"{root} already holds checkpoints ({', '.join(existing[:5])}). Choose a new "
            "output_dir, or pass overwrite_output_dir=True (--overwrite_output_dir true) to "
            "delete them and start over."
        )
    if existing:
        shutil.rmtree(root)
    Path(output_dir).mkdir(parents=True, exist_ok=True)


class Checkpointer:
    """Writes `checkpoints/<step>/{state,meta}` under output_dir, keeping the newest K."""

    def __init__(self, output_dir: str | Path, *, max_to_keep: int | None = None):
        import orbax.checkpoint as ocp

        self.root = checkpoints_root(output_dir)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=True, create=True
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
        return ocp.StandardCheckpointer().restore(state_dir, target)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise CheckpointError(
            f"Could not restore the train state from {state_dir}: {err}. The checkpoint was "
            "probably written for a different model or optimizer configuration."
        ) from err


def read_metadata(path: str | Path) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    meta_dir = Path(path).absolute() / "meta"
    if not meta_dir.is_dir():
        raise CheckpointError(f"{path} has no 'meta' folder; is it a jaxtrain checkpoint?")
    return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(meta_dir)

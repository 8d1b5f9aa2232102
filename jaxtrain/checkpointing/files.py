"""Checkpoint files on disk: where they live, which are committed, reading them back.

A step directory `checkpoints/<step>/` holds `state/` (the TrainState as tensorstore files),
`meta/` (arguments, model config, data position, trackers as JSON), `checksums.json`, and
`extra/` when a task trainer kept arrays beside the state (GRPO: the generated batch of a
round it stopped inside). Nothing is pickled.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax

from jaxtrain.checkpointing.quiet import quiet_orbax
from jaxtrain.errors import CheckpointError, first_sentences
from jaxtrain.state import TrainState

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


def restore_state(path: str | Path, abstract_state: TrainState) -> TrainState:
    """Read the train state saved in the step directory `path` onto `abstract_state`'s layout.

    `abstract_state` is a TrainState of arrays or jax.ShapeDtypeStruct (with shardings) that
    fixes the structure, shapes and placement to restore into.
    """
    state_dir = Path(path).absolute() / "state"
    if not state_dir.is_dir():
        raise CheckpointError(
            f"{path} is not a jaxtrain checkpoint step directory (no 'state' folder). "
            "Pass a directory like <output_dir>/checkpoints/<step>."
        )
    return _restore_standard(
        state_dir,
        abstract_state,
        "the train state",
        "Either its files are damaged, or it was written for another model or optimizer "
        "configuration. Delete that step directory to resume from the previous checkpoint, "
        "pass --reset_optimizer true if only the optimizer changed, or start a new run in a "
        "new output_dir.",
    )


def restore_extra(path: str | Path, abstract: Any) -> Any:
    """The arrays a task trainer kept beside the train state in the step directory `path`
    (its `extra/` item), read onto `abstract`'s shapes, dtypes and shardings."""
    extra_dir = Path(path).absolute() / "extra"
    if not extra_dir.is_dir():  # its metadata says it has one: a file went missing
        raise damaged(Path(path), extra_dir, "the folder is missing")
    return _restore_standard(
        extra_dir,
        abstract,
        "the task trainer's arrays",
        "Either its files are damaged, or the run's settings changed their shapes (e.g. "
        "max_completion_length). Resume with the settings of the run that wrote it, or from "
        "another checkpoint.",
    )


def _restore_standard(folder: Path, abstract: Any, what: str, advice: str) -> Any:
    import orbax.checkpoint as ocp

    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)
    quiet_orbax()
    try:
        with ocp.StandardCheckpointer() as checkpointer:  # closed: no stray async threads
            return checkpointer.restore(folder, target)
    except Exception as err:  # re-raised with the path and what to do; never ignored
        raise CheckpointError(
            f"Could not restore {what} from {folder}: {type(err).__name__}: "
            f"{_first_line(err)}. {advice}"
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
    quiet_orbax()
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
            f"Could not restore the parameters from {state_dir}: {type(err).__name__}: "
            f"{_first_line(err)}. "
            "The checkpoint's files are damaged or it belongs to another model."
        ) from err
    return restored["params"]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The JSON metadata (step, arguments, model config, data position, trackers) saved
    beside the train state in the step directory `path`."""
    import orbax.checkpoint as ocp

    step_dir = Path(path).absolute()
    meta_dir = step_dir / "meta"
    if not meta_dir.is_dir():
        raise CheckpointError(f"{path} has no 'meta' folder; is it a jaxtrain checkpoint?")
    quiet_orbax()
    try:
        with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as checkpointer:
            metadata = checkpointer.restore(meta_dir)
    except Exception as err:  # re-raised naming the file and the way forward
        named = meta_dir / "metadata" if (meta_dir / "metadata").exists() else meta_dir
        raise damaged(
            step_dir, named, f"unreadable ({type(err).__name__}: {_first_line(err)})"
        ) from err
    if not isinstance(metadata, dict) or "step" not in metadata:
        raise damaged(step_dir, meta_dir, "it holds no step; not a jaxtrain checkpoint's metadata")
    return metadata


def _first_line(err: BaseException) -> str:
    """The gist of a library error (Tensorstore appends its whole JSON spec)."""
    return first_sentences(str(err), 400)


def damaged(step_dir: Path, path: Path, why: str) -> CheckpointError:
    """A CheckpointError for a damaged file of the checkpoint `step_dir`, offering the
    previous committed checkpoint of the same run when there is one."""
    step_dir = Path(step_dir)
    return CheckpointError(
        f"Checkpoint {step_dir} is damaged: {path}: {why}. Nothing was restored. "
        + previous_checkpoint_advice(step_dir)
    )


def previous_checkpoint_advice(step_dir: Path) -> str:
    """How to go on from the committed checkpoint before `step_dir`, if there is one."""
    step_dir = Path(step_dir)
    if not step_dir.name.isdigit():
        return "Resume from another checkpoint or start a new run in a new output_dir."
    older = [s for s in committed_steps(step_dir.parent) if s < int(step_dir.name)]
    if not older:
        return "There is no older committed checkpoint; start a new run in a new output_dir."
    previous = step_dir.parent / str(older[-1])
    return (
        f"The previous committed checkpoint is {previous}: delete {step_dir} (or move it "
        f"out of {step_dir.parent}) and run again to resume from there, or pass "
        f"--resume_from {previous} with a new output_dir."
    )

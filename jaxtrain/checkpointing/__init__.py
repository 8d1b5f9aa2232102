"""Checkpointing: a run's checkpoints (`RunCheckpoints`), and reading them back.

- `run.py`: where a run starts (fresh, resumed, `resume_from`), its saves, keep-N, close;
- `compat.py`: whether a checkpoint fits this run (model, optimizer), trimming the metric log;
- `files.py`: the files on disk (committed steps, restore, metadata);
- `lock.py`: one run at a time in an output_dir.
"""

from jaxtrain.checkpointing.files import (
    CheckpointError,
    checkpoints_root,
    committed_steps,
    find_checkpoint,
    read_metadata,
    restore_extra,
    restore_params,
    restore_state,
)
from jaxtrain.checkpointing.lock import hold_output_dir
from jaxtrain.checkpointing.run import (
    CheckpointSettings,
    RunCheckpoints,
    RunStart,
    StartPlan,
    load_checked,
)

__all__ = [
    "CheckpointError",
    "CheckpointSettings",
    "RunCheckpoints",
    "RunStart",
    "StartPlan",
    "checkpoints_root",
    "committed_steps",
    "find_checkpoint",
    "hold_output_dir",
    "load_checked",
    "read_metadata",
    "restore_extra",
    "restore_params",
    "restore_state",
]

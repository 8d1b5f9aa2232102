"""Old home of the checkpoint functions, kept so existing imports work: use
`jaxtrain.checkpointing`."""

from jaxtrain.checkpointing.files import (  # noqa: F401
    CheckpointError,
    checkpoints_root,
    committed_steps,
    find_checkpoint,
    read_metadata,
    restore_params,
    restore_state,
)

"""One of two real JAX processes (4 CPU devices each) training together.

`python multihost_worker.py PORT PROCESS_ID OUT_DIR` writes OUT_DIR/process_<id>.json:
the logged losses, the dataset rows this process read and its local batch shape.
`python multihost_worker.py PORT PROCESS_ID OUT_DIR packed` trains packed rows for 4 steps,
then resumes a second run from the first's step-2 checkpoint, and writes
OUT_DIR/packed_<id>.json: both runs' losses and the checkpoint's data state.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    MESHES,
    LossRecorder,
    eval_dataset,
    factory,
    parallel_arguments,
    token_dataset,
)


class RecordingRows(list):
    """A list-of-dicts dataset that remembers which rows were read."""

    def __init__(self, rows):
        super().__init__(rows)
        self.read: list[int] = []

    def __getitem__(self, index):
        if isinstance(index, int):
            self.read.append(index)
        return super().__getitem__(index)


def main(port: str, process_id: str, out_dir: str) -> None:
    from jaxtrain import Trainer

    rows = RecordingRows([{"input_ids": list(r["input_ids"])} for r in token_dataset()])
    args = parallel_arguments(
        out_dir + "/run",
        sharding_axis_dims=MESHES["dp2_fsdp2_tp2"],
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        distributed_timeout_s=60,
        save_final=True,
        evaluation_strategy="steps",
        eval_steps=3,
    )
    recorder = LossRecorder()
    trainer = Trainer(
        arguments=args,
        model=factory(),
        dataset_train=rows,
        dataset_eval=eval_dataset(),
        callbacks=[recorder],
    )
    import jax

    rows.read.clear()  # validation peeks at rows; count only what training reads
    local_shape = list(trainer.train_source.loader.batch_at(0)[0]["input_ids"].shape)
    rows.read.clear()
    output = trainer.train()
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
        "losses": recorder.losses,
        "eval_loss": output.metrics["eval/loss"],
        "rows_read": rows.read,
        "local_batch_shape": local_shape,
        "checkpoint": output.checkpoint_path,
        "global_indices": [
            trainer.train_source.loader.global_indices(s).tolist()
            for s in range(len(rows.read) // 8)
        ],
    }
    Path(out_dir, f"process_{process_id}.json").write_text(json.dumps(result))


def packed_resume(port: str, process_id: str, out_dir: str) -> None:
    """Packing gives each process its own data position; a resume must restore each one."""
    from jaxtrain import Trainer

    rows = [{"input_ids": list(r["input_ids"])} for r in token_dataset()]

    def run(name: str, **overrides) -> list[float]:
        args = parallel_arguments(
            f"{out_dir}/{name}",
            sharding_axis_dims=MESHES["dp2_fsdp2_tp2"],
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=int(process_id),
            distributed_timeout_s=60,
            packing=True,
            max_steps=4,
            save_steps=2,
            **overrides,
        )
        recorder = LossRecorder()
        Trainer(arguments=args, model=factory(), dataset_train=rows, callbacks=[recorder]).train()
        return recorder.losses

    straight = run("straight")
    resumed = run("resumed", resume_from=f"{out_dir}/straight/checkpoints/2")
    from jaxtrain.checkpointing import read_metadata

    metadata = read_metadata(f"{out_dir}/straight/checkpoints/2")
    result = {"straight": straight, "resumed": resumed, "data_state": metadata["data_state"]}
    Path(out_dir, f"packed_{process_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[4:] == ["packed"]:
        packed_resume(*sys.argv[1:4])
    else:
        main(*sys.argv[1:4])

"""Subprocess worker: Gemma 3 with images fine-tuned on dp2 x fsdp2 x tp2 (8 CPU devices) and on
one device. `python vlm_mesh_worker.py OUT.json` writes each run's per-step losses, its final
parameters' norms, and the shardings of the trained kernels."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from vlm_fixtures import conversations, write_checkpoint  # noqa: E402

from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer  # noqa: E402
from jaxtrain.trainers import SFTArguments, SFTTrainer  # noqa: E402

MESHES = {"single": (1, 1, 1, 1, 1), "dp2_fsdp2_tp2": (2, 2, 1, 2, 1)}


class Losses:
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_step_end(self, trainer, state, metrics, step) -> None:
        self.values.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))


def main(out: str) -> None:
    base = write_checkpoint(Path(tempfile.mkdtemp()) / "base")
    results = {}
    for name, dims in MESHES.items():
        losses = Losses()
        args = SFTArguments(
            output_dir=tempfile.mkdtemp(), max_steps=3, total_batch_size=8,
            max_sequence_length=48, images_per_row=2, packing=False, learning_rate=3e-3,
            warmup_steps=0, progress_bar="none", run_report=False, save_final=False,
            sharding_axis_dims=list(dims),
        )  # fmt: skip
        trainer = SFTTrainer(
            arguments=args, model=AutoModelForCausalLM.from_pretrained(str(base)),
            dataset_train=datasets.Dataset.from_list(conversations(16)),
            processing_class=load_tokenizer(base), callbacks=[losses],
            devices=jax.devices()[: int(np.prod(dims))],
        )  # fmt: skip
        state = trainer.train().state
        flat = nnx.to_flat_state(state.params)
        results[name] = {
            "losses": losses.values,
            "norms": {"/".join(map(str, p)): float(np.linalg.norm(np.asarray(v[...])))
                      for p, v in flat},
            "specs": {"/".join(map(str, p)): str(v[...].sharding.spec) for p, v in flat},
        }  # fmt: skip
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])

"""Subprocess worker: ORPO (a token-mean term over the global batch), KTO (the KL estimate
over a micro-batch's rows on every device) and packed DPO (rows of packed pairs, per-pair
sums gathered across devices) on dp2 x fsdp2 x tp2 of 8 CPU devices and on one device.

`python preference_mesh_worker.py OUT.json` writes each run's per-step losses.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from sharded_worker import tokenizer  # noqa: E402
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model  # noqa: E402

from jaxtrain.trainers import (  # noqa: E402
    DPOArguments,
    DPOTrainer,
    KTOArguments,
    KTOTrainer,
    ORPOArguments,
    ORPOTrainer,
)

MESHES = {"single": (1, 1, 1, 1, 1), "dp2_fsdp2_tp2": (2, 2, 1, 2, 1)}
RUNS = {
    "orpo": (ORPOTrainer, ORPOArguments, {"beta": 0.5}),
    "kto": (KTOTrainer, KTOArguments, {"undesirable_weight": 1.5, "beta": 0.5}),
    "dpo_packed": (DPOTrainer, DPOArguments, {"packing": True}),
}


def main(out: str) -> None:
    results: dict[str, dict[str, list[float]]] = {}
    for run, (cls, args_cls, extra) in RUNS.items():
        for mesh, dims in MESHES.items():
            seen = StepMetrics()
            args = tiny_arguments(
                args_cls,
                Path(tempfile.mkdtemp()),
                max_steps=2,
                sharding_axis_dims=list(dims),
                adam_epsilon=1e-3,
                **extra,
            )
            cls(
                arguments=args,
                model=tiny_model(num_attention_heads=4, num_key_value_heads=2),
                dataset_train=addition_pairs(32),
                processing_class=tokenizer(),
                callbacks=[seen],
                devices=jax.devices()[: int(np.prod(dims))],
            ).train()
            results.setdefault(run, {})[mesh] = [s["loss_sum"] / s["tokens"] for s in seen.steps]
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])

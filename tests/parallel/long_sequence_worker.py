"""Loss of 2 steps at seq 256 (blocked causal attention) on the mesh given as argv[1]."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import json  # noqa: E402

import datasets  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import CONFIG, VOCAB, LossRecorder, parallel_arguments  # noqa: E402
from flax import nnx  # noqa: E402

from jaxtrain import Trainer  # noqa: E402
from jaxtrain.models import LlamaForCausalLM  # noqa: E402

SEQ = 256
dims = tuple(int(d) for d in sys.argv[1].split(","))
rng = np.random.default_rng(0)
rows = [rng.integers(1, VOCAB - 1, size=SEQ).tolist() for _ in range(8)]
recorder = LossRecorder()
trainer = Trainer(
    arguments=parallel_arguments(
        sys.argv[2],
        sharding_axis_dims=dims,
        max_steps=2,
        total_batch_size=4,
        max_sequence_length=SEQ,
        packing=True,
    ),  # fmt: skip
    model=LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0)),
    dataset_train=datasets.Dataset.from_dict({"input_ids": rows}),
    callbacks=[recorder],
    devices=jax.devices()[: int(np.prod(dims))],
)
trainer.train()
print(json.dumps(recorder.losses))

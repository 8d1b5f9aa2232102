"""Subprocess worker: DPO with LoRA and distillation on 8 CPU devices vs one device.

`python sharded_worker.py OUT.json` writes the first losses of each run and the shardings of
the frozen weights (the reference's, the teacher's and LoRA's base kernels).
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

import datasets  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model  # noqa: E402

from jaxtrain.trainers import DPOArguments, DPOTrainer  # noqa: E402

MESHES = {"single": (1, 1, 1, 1, 1), "dp2_fsdp2_tp2": (2, 2, 1, 2, 1)}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trainer_fixtures import WORDS
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, ":": 4}
    vocab.update({w: i + 5 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def main(out: str) -> None:
    results = {}
    rows = datasets.Dataset.from_list(addition_pairs(16))
    for name, dims in MESHES.items():
        seen = StepMetrics()
        args = tiny_arguments(
            DPOArguments,
            Path(tempfile.mkdtemp()),
            max_steps=2,
            sharding_axis_dims=list(dims),
            lora_rank=4,
            lora_targets=["attention", "mlp"],
            adam_epsilon=1e-3,
        )
        trainer = DPOTrainer(
            arguments=args,
            model=tiny_model(num_attention_heads=4, num_key_value_heads=2),
            dataset_train=rows,
            processing_class=tokenizer(),
            callbacks=[seen],
            devices=jax.devices()[: int(np.prod(dims))],
        )
        trainer.train()
        frozen = trainer.program.frozen_state()
        specs = {
            "/".join(map(str, p)): str(v[...].sharding.spec)
            for p, v in nnx.to_flat_state(frozen)
            if p[-1] == "kernel"
        }
        results[name] = {
            "losses": [s["loss_sum"] / s["tokens"] for s in seen.steps],
            "specs": specs,
        }
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])

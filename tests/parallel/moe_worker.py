"""Subprocess worker for test_expert_parallel.py: an MoE model trained on (dp, fsdp, ep, tp)
meshes of 8 CPU devices. `python moe_worker.py OUT_DIR` writes OUT_DIR/results.json."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import LossRecorder, parallel_arguments, token_dataset  # noqa: E402
from flax import nnx  # noqa: E402

from jaxtrain import Trainer  # noqa: E402
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM  # noqa: E402
from jaxtrain.parallel import ModelFactory  # noqa: E402

MOE_MESHES = {
    "single": (1, 1, 1, 1, 1),
    "dp4_ep2": (4, 1, 2, 1, 1),
    "fsdp2_ep4": (1, 2, 4, 1, 1),
    "dp2_ep2_tp2": (2, 1, 2, 2, 1),
    # The GPU's Pallas kernels (interpreted): per device under shard_map, with and without ep.
    "dp2_fsdp2_kernel": (2, 2, 1, 1, 1),
    "dp2_ep2_kernel": (2, 1, 2, 1, 1),
}
CONFIG = MoeConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=16,
    router_aux_loss_coef=0.01,
    router_z_loss_coef=0.001,
    model_type="qwen2_moe",
)


class LogRecorder(LossRecorder):
    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict] = []

    def on_log(self, trainer, logs, step) -> None:
        super().on_log(trainer, logs, step)
        self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})


def main(out_dir: str) -> None:
    out = Path(out_dir)
    results: dict = {"runs": {}}
    dataset = token_dataset()
    finals = {}
    for name, dims in MOE_MESHES.items():
        kernel = "interpret" if name.endswith("_kernel") else None
        config = dataclasses.replace(CONFIG, moe_implementation=kernel)
        recorder = LogRecorder()
        trainer = Trainer(
            arguments=parallel_arguments(
                str(out / name),
                sharding_axis_dims=dims,
                optimizer="sgd",
                learning_rate=0.5,
                max_steps=2,
            ),
            model=ModelFactory(lambda config=config: MoeForCausalLM(config, rngs=nnx.Rngs(0))),
            dataset_train=dataset,
            callbacks=[recorder],
            devices=jax.devices()[: int(np.prod(dims))],
        )
        output = trainer.train()
        finals[name] = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(output.state.params))]
        leaves = jax.tree_util.tree_leaves_with_path(output.state.params)
        results["runs"][name] = {
            "losses": recorder.losses,
            "logs": recorder.logs,
            "shards": {
                jax.tree_util.keystr(p).removesuffix(".value"): [
                    list(x.shape),
                    list(x.addressable_shards[0].data.shape),
                ]
                for p, x in leaves
            },
        }
        if name == "dp4_ep2":
            results["dry_run"] = trainer.dry_run()
    for name in MOE_MESHES:
        diff = max(
            float(np.abs(a - b).max()) for a, b in zip(finals["single"], finals[name], strict=True)
        )
        results["runs"][name]["max_param_diff"] = diff
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])

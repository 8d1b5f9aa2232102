"""Asynchronous GRPO with the engine on devices of its own (rollout_devices=2 of 4 CPU
devices: training on the first two) against the same run sampling on its 2 training devices;
writes each run's parameters to argv[1]/<name>.npz and prints their completions and devices."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from grpo_worker import CONFIG, length_reward, tokenizer  # noqa: E402

from jaxtrain.models import LlamaForCausalLM  # noqa: E402
from jaxtrain.trainers import GRPOArguments, GRPOTrainer  # noqa: E402


def run(name: str, out: Path, **options) -> dict:
    completions = []

    class Seen:
        def on_step_end(self, trainer, state, metrics, step):
            completions.append(list(trainer.last_completions))

    args = GRPOArguments(
        output_dir=str(out / name), max_steps=3, num_iterations=1, max_staleness=1,
        total_batch_size=8, num_generations=4, max_prompt_length=6, max_completion_length=4,
        beta=0.04, learning_rate=1e-2, warmup_steps=0, logging_steps=1, temperature=1.0,
        evaluation_strategy="no", save_final=False, progress_bar="none", run_report=False, seed=3,
        rollout_warm_up=False, **options,
    )  # fmt: skip
    rows = [{"prompt": f"what is {i % 7} + {i % 5} ?"} for i in range(8)]
    trainer = GRPOTrainer(
        arguments=args,
        model=LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0)),
        reward_funcs=[length_reward],
        dataset_train=rows,
        processing_class=tokenizer(),
        callbacks=[Seen()],
        devices=None if options.get("rollout_devices") else jax.devices()[:2],
    )
    output = trainer.train()
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(output.state.params))]
    np.savez(out / f"{name}.npz", *leaves)
    engine_leaves = jax.tree.leaves(trainer.train_source.engine.state)
    ids = lambda arrays: sorted({d.id for x in arrays for d in x.sharding.device_set})  # noqa: E731
    return {
        "completions": completions,
        "train_devices": ids(jax.tree.leaves(output.state.params)),
        "engine_devices": ids(engine_leaves),
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    print(json.dumps({"split": run("split", out, rollout_devices=2), "plain": run("plain", out)}))

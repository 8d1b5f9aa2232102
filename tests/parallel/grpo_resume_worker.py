"""GRPO on a dp=2 x fsdp=2 mesh of 4 CPU devices, rounds of 2 updates: a run stopped after
step 3 (inside its second round; the final save keeps the round's batch) and resumed, beside
an uninterrupted run. Writes both runs' parameters to argv[1]/{whole,resumed}.npz and prints
their completions after step 3 and the placement of the batch the resumed step consumed."""

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

DIMS = (2, 2, 1, 1, 1)


class Seen:
    """Each step's completions and the placement of the batch it consumed; stops the run
    after step `stop_after`."""

    def __init__(self, stop_after=None):
        self.completions, self.batches, self.stop_after = {}, {}, stop_after

    def on_batch(self, trainer, batch, step):  # after the trainer's: the batch the step takes
        ids = batch["input_ids"]
        self.batches[step + 1] = [len(ids.sharding.device_set), str(ids.sharding.spec)]

    def on_step_end(self, trainer, state, metrics, step):
        self.completions[step] = list(trainer.last_completions)
        if step == self.stop_after:
            trainer.should_stop = True


def run(out: Path, seen: Seen) -> list[np.ndarray]:
    args = GRPOArguments(
        output_dir=str(out), sharding_axis_dims=DIMS, max_steps=4, num_iterations=2,
        total_batch_size=16, num_generations=4, max_prompt_length=6, max_completion_length=4,
        beta=0.04, learning_rate=1e-2, adam_epsilon=1e-3, warmup_steps=0, logging_steps=1,
        evaluation_strategy="no", save_final=True, progress_bar="none", run_report=False, seed=3,
        rollout_warm_up=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        arguments=args,
        model=LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0)),
        reward_funcs=[length_reward],
        dataset_train=[{"prompt": f"what is {i % 7} + {i % 5} ?"} for i in range(8)],
        processing_class=tokenizer(),
        callbacks=[seen],
        devices=jax.devices()[: int(np.prod(DIMS))],
    )
    output = trainer.train()
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(output.state.params))]


out = Path(sys.argv[1])
whole, part, rest = Seen(), Seen(stop_after=3), Seen()
full = run(out / "a", whole)
run(out / "b", part)
resumed = run(out / "b", rest)
np.savez(out / "whole.npz", *full)
np.savez(out / "resumed.npz", *resumed)
print(json.dumps({
    "extra": sorted(p.name for p in (out / "b" / "checkpoints" / "3").iterdir()),
    "steps": sorted(rest.completions),
    "same_completions": all(rest.completions[s] == whole.completions[s] for s in rest.completions),
    "batch": rest.batches[4],
    "batch_whole": whole.batches[4],
}))  # fmt: skip

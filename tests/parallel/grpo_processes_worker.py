"""GRPO with sampled rollouts on a dp=2 x fsdp=2 mesh: in one process of 4 CPU devices, or as
one of two real JAX processes of 2 devices each (each generating its share of the prompts).

    python grpo_processes_worker.py OUT one
    python grpo_processes_worker.py OUT two PORT PROCESS_ID

Writes OUT/<one|two_ID>.json (every logged value, each round's completions, the evaluation's
metrics) and OUT/<one|two_ID>.npz (the final parameters, gathered whole).
"""

import os
import sys
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from grpo_worker import CONFIG, tokenizer  # noqa: E402

# After that import (it sets 4 devices for itself); JAX reads the flag when it first runs.
os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=" + (
    "4" if sys.argv[2] == "one" else "2"
)

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxtrain import ModelFactory  # noqa: E402
from jaxtrain.models import LlamaForCausalLM  # noqa: E402
from jaxtrain.trainers import GRPOArguments, GRPOTrainer  # noqa: E402


def digit_reward(prompts, completions, **_):
    """The share of a completion's words that are numbers: something the policy can learn."""
    return [sum(w.isdigit() for w in c.split()) / max(len(c.split()), 1) for c in completions]


def train(out: Path, callbacks: list, distributed: dict) -> GRPOTrainer:
    args = GRPOArguments(
        output_dir=str(out), sharding_axis_dims=(2, 2, 1, 1, 1), max_steps=4,
        num_iterations=2, total_batch_size=16, gradient_accumulation_steps=2,
        num_generations=4, max_prompt_length=6, max_completion_length=6, temperature=0.7,
        beta=0.04, epsilon=0.2, learning_rate=2e-2, optimizer="adamw", warmup_steps=0,
        logging_steps=1, evaluation_strategy="steps", eval_steps=2, eval_num_generations=2,
        eval_pass_threshold=0.6, save_final=True, progress_bar="none", run_report=False, seed=5,
        lora_rank=4, rollout_warm_up=False, **distributed,
    )  # fmt: skip
    prompts = [{"prompt": f"what is {i % 7} + {i % 5} ?"} for i in range(8)]
    eval_prompts = [{"prompt": f"what is {i} + 1 ?"} for i in range(3)]  # shares of 2 and 1
    return GRPOTrainer(
        arguments=args,
        # Built once the cluster is formed (an eager model would start JAX before it).
        model=ModelFactory(lambda: LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0))),
        reward_funcs=[digit_reward],
        dataset_train=prompts,
        dataset_eval=eval_prompts,
        processing_class=tokenizer(),
        callbacks=callbacks,
    )


def gathered(state) -> dict[str, np.ndarray]:
    return {
        str(i): np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for i, x in enumerate(jax.tree.leaves(state.params))
    }


class StopAfter:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, state, metrics, step):
        if step == self.step:
            trainer.should_stop = True


def main(out: Path, mode: str, port: str = "", process_id: str = "0") -> None:
    name = "one" if mode == "one" else f"two_{process_id}"
    distributed = {}
    if mode == "two":
        distributed = dict(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=int(process_id), distributed_timeout_s=120)  # fmt: skip
    logs, rounds, evals = [], [], []

    class Record:
        def on_log(self, trainer, values, step):
            logs.append({"step": step, **{k: float(v) for k, v in values.items()}})

        def on_step_end(self, trainer, state, metrics, step):
            rounds.append(list(trainer.last_completions))

        def on_evaluate(self, trainer, metrics, step):
            evals.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    # Its own directory per run: the one-process run writes at the same time as the two.
    trainer = train(out / f"run_{mode}", [Record()], distributed)
    output = trainer.train()
    np.savez(out / f"{name}.npz", **gathered(output.state))
    last = trainer.train_source._round
    result = {
        "processes": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "logs": logs,
        "rounds": rounds,
        "evals": evals,
        "engine_devices": len(jax.tree.leaves(trainer.train_source.engine.pool)[0].devices()),
    }
    if mode == "two":
        # Stopped after update 3, inside the second round (the final save keeps its batch),
        # then resumed in the same directory: the last update reuses the restored round.
        train(out / "resumed", [StopAfter(3)], distributed).train()
        resumed = train(out / "resumed", [], distributed)
        params = gathered(resumed.train().state)
        np.savez(out / f"resumed_{process_id}.npz", **params)
        restored = resumed.train_source._round
        result["restored_rows_are_this_process_rows"] = all(
            np.array_equal(restored.host[k], last.host[k]) for k in ("input_ids", "labels")
        )
        result["local_rows"] = list(last.host["input_ids"].shape)
    (out / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])

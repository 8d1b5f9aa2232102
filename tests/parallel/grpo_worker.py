"""GRPO updates on fixed completions, on one device and on a dp=2 x fsdp=2 mesh of 4 CPU
devices; writes each run's parameters after every update to argv[1]/<mesh>.npz."""

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
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from jaxtrain.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from jaxtrain.trainers import GRPOArguments, GRPOTrainer  # noqa: E402
from jaxtrain.trainers.rollout_rows import MODEL, RolloutRows  # noqa: E402

WORDS = ["<pad>", "<unk>", "<s>", "</s>"] + [str(i) for i in range(20)] + ["+", "what", "is", "?"]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                     eos_token_id=3, initializer_range=0.2)  # fmt: skip
COMPLETION = 6


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


class FixedCompletions(GRPOTrainer):
    """The sampler's output replaced by fixed tokens (a function of the round's rows and
    step), so both meshes update on the same batch; rewards, advantages, the batch's
    placement on the mesh, the old log-probs and the train step are the trainer's own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.train_source.sample = self.fixed_tokens  # what RolloutSource.sample returns

    def fixed_tokens(self, state, rows, mine, step, attempt=0):
        rng = np.random.default_rng([int(rows.sum()), step])
        tokens = rng.integers(4, len(WORDS), (len(rows), COMPLETION)).astype(np.int32)
        ends = rng.integers(1, COMPLETION + 2, len(rows))  # some never end (truncated)
        out = RolloutRows.empty(len(mine), 6, COMPLETION, 3)
        for j, i in enumerate(mine):
            n = min(ends[i], COMPLETION)
            if ends[i] <= COMPLETION:
                tokens[i, n - 1] = 3
            # The sampler's log-probs are 0: the agreement this logs is not what the test
            # checks.
            prompt = self.train_source.prompts.ids[rows[i]]
            out.put(j, prompt, tokens[i, :n], np.zeros(n), MODEL)
        return out


def length_reward(prompts, completions, **_):
    return [len(c.split()) / COMPLETION for c in completions]


def run(name: str, dims: tuple[int, ...], out: Path) -> dict:
    snapshots = []

    class Snapshot:
        def on_step_end(self, trainer, state, metrics, step):
            snapshots.append([np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))])

    args = GRPOArguments(
        output_dir=str(out / name), sharding_axis_dims=dims, max_steps=2, num_iterations=2,
        total_batch_size=16, num_generations=4, max_prompt_length=6,
        max_completion_length=COMPLETION, beta=0.04, epsilon=0.05, learning_rate=1e-2,
        optimizer="adamw", adam_epsilon=1e-3, warmup_steps=0, logging_steps=1,
        evaluation_strategy="no", save_final=False, progress_bar="none", run_report=False, seed=3,
        rollout_warm_up=False,
    )  # fmt: skip
    rows = [{"prompt": f"what is {i % 7} + {i % 5} ?"} for i in range(8)]
    trainer = FixedCompletions(
        arguments=args,
        model=LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0)),
        reward_funcs=[length_reward],
        dataset_train=rows,
        processing_class=tokenizer(),
        callbacks=[Snapshot()],
        devices=jax.devices()[: int(np.prod(dims))],
    )
    output = trainer.train()
    leaves = jax.tree.leaves(output.state.params)
    np.savez(out / f"{name}.npz", **{f"{s}_{i}": x for s, leaves_s in enumerate(snapshots)
                                    for i, x in enumerate(leaves_s)})  # fmt: skip
    return {
        "devices": len(leaves[0].sharding.device_set),
        "sharded": any(not x.sharding.is_fully_replicated for x in leaves),
        "steps": len(snapshots),
    }


if __name__ == "__main__":  # grpo_resume_worker.py imports the model and tokenizer
    out = Path(sys.argv[1])
    print(json.dumps({
        "single": run("single", (1, 1, 1, 1, 1), out),
        "dp2_fsdp2": run("dp2_fsdp2", (2, 2, 1, 1, 1), out),
    }))  # fmt: skip

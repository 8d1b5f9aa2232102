"""RLOOTrainer on the engine: it trains and logs what TRL's RLOOTrainer logs, and a round's
advantages are RLOO's of that round's rewards and of the KL of its completions to the
reference, recomputed here from the state's policy and the reference (a frozen copy, or
with LoRA the base without adapters, an NF4 one with QLoRA)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_grpo_trl_objectives import Logs, first_is_big
from trainer_fixtures import tiny_arguments, tiny_model

from jaxtrain.models.lora import adapters_off
from jaxtrain.quantization import QuantizedKernel
from jaxtrain.rollout_arguments import RLOOArguments
from jaxtrain.trainers import RLOOTrainer, rloo_advantages
from jaxtrain.training.logps import model_token_logps


def length_reward(prompts, completions, **_):
    return [len(c.split()) / 4 for c in completions]


# The reference: a frozen copy; with LoRA the base without adapters; with QLoRA an NF4 base.
REFERENCES = {
    "copy": {},
    "lora": {"lora_rank": 4},
    "qlora": {"lora_rank": 4, "quantization": "nf4", "quantization_block_size": 32},
}


@pytest.mark.parametrize("reference", list(REFERENCES))
def test_rloo_trains_and_its_advantages_are_rloo_of_the_round(tokenizer, tmp_path, reference):
    logs = Logs()
    lora = REFERENCES[reference]
    args = tiny_arguments(
        RLOOArguments, tmp_path, max_steps=4, total_batch_size=8, num_generations=4,
        max_prompt_length=8, max_completion_length=4, num_iterations=2, beta=0.5,
        learning_rate=5e-2, normalize_advantages=True, **lora,
    )  # fmt: skip
    rows = [{"prompt": f"what is {i % 7} + {(3 * i) % 5} ?"} for i in range(8)]
    trainer = RLOOTrainer(
        arguments=args, model=tiny_model(), reward_funcs=[first_is_big, length_reward],
        dataset_train=rows, processing_class=tokenizer, callbacks=[logs],
    )  # fmt: skip
    if reference == "qlora":  # the policy's base is stored quantized
        policy = trainer.program.parts.model
        assert any(isinstance(m, QuantizedKernel) for _, m in nnx.iter_modules(policy))
    output = trainer.train()
    assert len(logs.logs) == 4
    for entry in logs.logs:
        assert np.isfinite(entry["loss"]) and entry["entropy"] > 0
        assert {"reward", "reward_std", "frac_reward_zero_std", "kl"} <= set(entry)
        assert {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"} <= set(
            entry
        )
    assert abs(logs.logs[0]["kl"]) < 1e-6  # the first round samples from the reference itself
    assert abs(logs.logs[2]["kl"]) > 1e-4  # the second from the updated policy

    # A new round from the final state, recomputed independently.
    source, program, state = trainer.train_source, trainer.program, output.state
    placed, round_logs, _ = source.generate_batch(state, 4)
    texts = source.last_completions
    rewards = np.asarray(first_is_big(None, texts)) + np.asarray(length_reward(None, texts))
    task = nnx.merge(program.graphdef, state.params, program.frozen_state())
    ids = jnp.asarray(placed["input_ids"]).reshape(8, -1)
    labels = jnp.asarray(placed["labels"]).reshape(8, -1)
    old, mask = model_token_logps(task.model, ids, labels)
    if task.reference is not None:
        ref, _ = model_token_logps(task.reference, ids, labels)
    else:
        with adapters_off(task.model) as base:
            ref, _ = model_token_logps(base, ids, labels)
    per_token = np.asarray((old - ref) * mask, np.float64)
    assert round_logs["kl"] == pytest.approx(per_token.sum() / float(mask.sum()), rel=1e-4)
    expected, _ = rloo_advantages(
        rewards, per_token.sum(-1), beta=0.5, num_generations=4, normalize=True
    )
    np.testing.assert_allclose(
        np.asarray(placed["advantages"]).reshape(-1), expected, rtol=1e-4, atol=1e-5
    )


def test_rloo_fields_are_its_own(tmp_path):
    from jaxtrain.errors import ArgumentError
    from jaxtrain.tasks import check_task_fields

    with pytest.raises(ArgumentError, match="scale_rewards is a field of --task grpo\\. "):
        check_task_fields(["scale_rewards"], "rloo", "config.yaml")
    with pytest.raises(ArgumentError, match=r"reward_clip_range=\[1.0, 0.0\] must be"):
        RLOOArguments(output_dir=str(tmp_path), total_batch_size=4, reward_clip_range=[1.0, 0.0])
    defaults = RLOOArguments(output_dir=str(tmp_path), total_batch_size=4)
    assert (defaults.num_generations, defaults.beta, defaults.epsilon_high) == (2, 0.05, 0.2)

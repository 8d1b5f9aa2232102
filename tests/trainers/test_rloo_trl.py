"""RLOO equals TRL 1.16's RLOOTrainer on the same batch, through TRL's own code: its advantages
and logged kl / reward / frac_reward_zero_std (`_generate_and_score_completions`, generation
replaced by fixed tokens: everything after it is TRL's, the reference log-probs included), and
its loss, gradient norm, entropy and clip ratios (`_compute_loss`), on-policy and at a later
iteration, rel 1e-5. TRL's defaults that would change these numbers are pinned."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_grpo_trl_objectives import loss_grad_and_means, tiny_llama

trl = pytest.importorskip("trl")

from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.data.collate import IGNORE_INDEX  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.rollout_arguments import RLOOArguments  # noqa: E402
from jaxtrain.trainers.frozen import TaskModel  # noqa: E402
from jaxtrain.trainers.rloo import rloo_advantages, rloo_objective  # noqa: E402
from jaxtrain.training.logps import model_token_logps  # noqa: E402

B, P, C, G = 8, 5, 7, 4  # completions, prompt length, completion length, group size
REWARDS = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.7, np.nan, 0.9])  # NaN: no function scored it
# TRL 1.16's defaults for RLOO that change these numbers, pinned (beta and epsilon_high set).
PINNED = dict(epsilon=0.2, num_iterations=1, mask_truncated_completions=False)
CASES = {
    "defaults_beta": dict(beta=0.05, temperature=1.0),
    "normalized_t07": dict(beta=0.1, temperature=0.7, normalize_advantages=True),
    "clipped_rewards": dict(beta=0.05, temperature=1.0, reward_clip_range=(0.1, 0.8)),
    "no_reference": dict(beta=0.0, temperature=1.0),
    "lonely_group": dict(beta=0.05, temperature=1.0, rewards=[1, 0, 0.5, 1, np.nan, np.nan, np.nan, 0.9]),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rloo_trl")
    return tiny_llama(0, root / "policy"), tiny_llama(1, root / "reference")


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 64, (B, P))
    completion = rng.integers(5, 64, (B, C))
    lengths = np.array([7, 3, 5, 7, 1, 6, 4, 2])
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int64)
    return prompt, np.where(mask == 1, completion, 0), mask, lengths


def trl_trainer(checkpoints, options, tmp_path, tokenizer, batch):
    """TRL's RLOOTrainer on the policy, its reference the other checkpoint (TRL builds its own
    from the policy's path; it is replaced, with the fused head TRL patches its own with), its
    generation replaced by the batch's tokens. Rewards come from a dataset column."""
    policy, reference = checkpoints
    prompt, completion, _, lengths = batch
    config = trl.RLOOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, num_generations=G,
        max_completion_length=C, use_cpu=True, report_to=[], bf16=False,
        gradient_checkpointing=False, epsilon_high=0.28, **PINNED, **options,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, attn_implementation="eager")
    trainer = trl.RLOOTrainer(
        model=model,
        reward_funcs=lambda completions, r, **_: [None if np.isnan(x) else x for x in r],
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": "1 + 2", "r": 0.0}] * B),
        processing_class=tokenizer,
    )
    if options["beta"] > 0:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            reference, attn_implementation="eager"
        )
        add_fused_lm_head(ref, temperature=options["temperature"])
        trainer.ref_model = ref.eval()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    completions = [list(map(int, c[:n])) for c, n in zip(completion, lengths)]
    trainer._generate = lambda prompts: ([list(map(int, p)) for p in prompt], completions,
                                         ["x"] * B)  # fmt: skip
    return trainer, model


def jaxtrain_rows(prompt, completion, mask):
    labels = np.concatenate([np.full_like(prompt, IGNORE_INDEX), completion], 1)
    labels[:, P:][mask == 0] = IGNORE_INDEX
    return np.concatenate([prompt, completion], 1), labels


@pytest.mark.parametrize("case", list(CASES))
def test_advantages_loss_and_logs_equal_trl(checkpoints, batch, tmp_path, tokenizer, case):
    options = dict(CASES[case])
    rewards = np.asarray(options.pop("rewards", REWARDS), np.float64)
    prompt, completion, mask, _ = batch
    trainer, model = trl_trainer(checkpoints, options, tmp_path, tokenizer, batch)
    inputs = trainer._generate_and_score_completions(
        [{"prompt": "1 + 2", "r": float(r)} for r in rewards]
    )
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grad = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters())))
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}

    # jaxtrain: its own models' log-probs, the KL sums, the advantages, the objective.
    t, beta = options["temperature"], options["beta"]
    ids, labels = jaxtrain_rows(prompt, completion, mask)
    policy = AutoModelForCausalLM.from_pretrained(checkpoints[0])
    old, token_mask = model_token_logps(
        policy, jnp.asarray(ids), jnp.asarray(labels), temperature=t
    )
    token_mask = np.asarray(token_mask, np.float64)
    kl = np.zeros(B)
    if beta > 0:
        reference = AutoModelForCausalLM.from_pretrained(checkpoints[1])
        ref, _ = model_token_logps(reference, jnp.asarray(ids), jnp.asarray(labels), temperature=t)
        per_token = (np.asarray(old, np.float64) - np.asarray(ref, np.float64)) * token_mask
        kl = per_token.sum(-1)
        np.testing.assert_allclose(per_token.sum() / token_mask.sum(), theirs["kl"], rtol=1e-5)
    else:
        assert "kl" not in theirs
    advantages, equal = rloo_advantages(
        rewards, kl, beta=beta, num_generations=G,
        normalize=options.get("normalize_advantages", False),
        clip_range=options.get("reward_clip_range"),
    )  # fmt: skip
    np.testing.assert_allclose(advantages, inputs["advantages"].numpy(), rtol=1e-5, atol=1e-6)
    assert equal.reshape(-1, G)[:, 0].mean() == pytest.approx(theirs["frac_reward_zero_std"])

    args = RLOOArguments(
        total_batch_size=B, num_generations=G, max_prompt_length=P, max_completion_length=C,
        epsilon_high=0.28, **PINNED, **{k: v for k, v in options.items() if k != "reward_clip_range"},
    )  # fmt: skip
    micro = {
        "input_ids": jnp.asarray(ids),
        "labels": jnp.asarray(labels),
        "advantages": jnp.asarray(advantages),
    }
    ours_loss, ours_grad, means = loss_grad_and_means(
        rloo_objective(RunSettings.from_arguments(args)), TaskModel(policy), micro
    )
    np.testing.assert_allclose(ours_loss, float(loss), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours_grad, grad, rtol=1e-5)
    np.testing.assert_allclose(means["entropy"], theirs["entropy"], rtol=1e-5)
    for name in ("low_mean", "high_mean", "region_mean"):
        assert theirs[f"clip_ratio/{name}"] == 0.0  # on-policy: the ratio is 1


def test_a_later_iteration_clips_as_trl_does(checkpoints, batch, tmp_path, tokenizer):
    """Old log-probs off by a shift per completion (a later update of the round): TRL reads
    their sums, jaxtrain the per-token values (the shift on each completion's first token)."""
    options = dict(beta=0.05, temperature=1.0)
    prompt, completion, mask, _ = batch
    trainer, model = trl_trainer(checkpoints, options, tmp_path, tokenizer, batch)
    inputs = trainer._generate_and_score_completions(
        [{"prompt": "1 + 2", "r": float(r)} for r in REWARDS]
    )
    shift = np.random.default_rng(1).normal(0, 0.35, B).astype(np.float32)
    later = dict(inputs, old_logps=inputs["old_logps"] + torch.as_tensor(shift))
    loss = trainer._compute_loss(trainer.model, later)
    loss.backward()
    grad = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters())))
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}

    ids, labels = jaxtrain_rows(prompt, completion, mask)
    policy = AutoModelForCausalLM.from_pretrained(checkpoints[0])
    old, _ = model_token_logps(policy, jnp.asarray(ids), jnp.asarray(labels))
    old = np.array(old)
    old[:, P - 1] += shift  # each completion's first token: its sum moves by the shift
    args = RLOOArguments(
        total_batch_size=B, num_generations=G, max_prompt_length=P, max_completion_length=C,
        epsilon_high=0.28, num_iterations=2, beta=0.05,
    )  # fmt: skip
    micro = {
        "input_ids": jnp.asarray(ids),
        "labels": jnp.asarray(labels),
        "advantages": jnp.asarray(inputs["advantages"].numpy()),
        "old_logps": jnp.asarray(old),
    }
    objective = rloo_objective(RunSettings.from_arguments(args))
    ours_loss, ours_grad, _ = loss_grad_and_means(objective, TaskModel(policy), micro)
    np.testing.assert_allclose(ours_loss, float(loss), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours_grad, grad, rtol=1e-5)
    sums = objective.loss_sums(TaskModel(policy), micro, None)
    assert theirs["clip_ratio/region_mean"] > 0  # the clip acts
    for name in ("low_mean", "high_mean", "region_mean"):
        key = f"clip_ratio/{name}"
        assert float(sums[key]) / B == pytest.approx(theirs[key], abs=1e-6), key

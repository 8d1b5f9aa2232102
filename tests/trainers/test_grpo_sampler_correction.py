"""The sampler/trainer agreement and TRL 1.16's importance-sampling correction of it.

- Equal to TRL: the same completions and sampler log-probs go through TRL's own scoring
  (`_generate_and_score_completions`, fed by a `rollout_func`, with the vLLM flag it reads
  for the correction) and loss (`_compute_loss`), and through jaxtrain's round measurement
  (`round_agreement`) and objective: loss, gradient norm, KL, clip ratio, entropy and the
  logged sampling/* values at rel 1e-5, for every correction mode and bound.
- In a run: a sampler on the trainer's own parameters agrees to float rounding; one handed
  stale parameters is measured (its log-probs are the stale policy's) and corrected.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from trainer_fixtures import tiny_arguments, tiny_model

trl = pytest.importorskip("trl")

from test_grpo_trl_objectives import (  # noqa: E402
    TRL_PINNED,
    B,
    C,
    G,
    P,
    batch,  # noqa: F401  (a module fixture)
    checkpoints,  # noqa: F401  (a module fixture)
    loss_grad_and_means,
    torch_logps,
)

from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.data.collate import IGNORE_INDEX  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.rollout_arguments import GRPOArguments  # noqa: E402
from jaxtrain.trainers import GRPOTrainer  # noqa: E402
from jaxtrain.trainers.frozen import TaskModel  # noqa: E402
from jaxtrain.trainers.grpo import grpo_objective  # noqa: E402
from jaxtrain.trainers.grpo_agreement import round_agreement  # noqa: E402
from jaxtrain.trainers.grpo_loss import group_advantages  # noqa: E402
from jaxtrain.training.logps import model_token_logps  # noqa: E402

REWARDS = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.7, 0.1, 0.9])
SAMPLING = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)
RATIO = tuple(f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max"))
# mode, (min, max) bounds, and what else the case sets.
CASES = {
    "token_truncate": ("token_truncate", (None, 3.0), {}),
    "token_truncate_both": ("token_truncate", (0.8, 1.5), {}),
    "token_mask": ("token_mask", (0.5, 2.0), {}),
    "sequence_truncate": ("sequence_truncate", (None, 3.0), {"loss_type": "grpo"}),
    "sequence_mask_trl_default": ("sequence_mask", (None, 3.0), {}),
    "sequence_mask_min_only": ("sequence_mask", (1.5, None), {}),
    "opsm_reads_the_sampler": (
        "token_truncate", (None, 3.0), {"off_policy_mask_threshold": 0.05}
    ),
}  # fmt: skip


def sampler_logps_of(policy, prompt, completion, temperature) -> np.ndarray:
    """A sampler whose log-probs are off the trainer's by ~exp(+-0.6) per token."""
    logps = torch_logps(policy, prompt, completion, temperature).numpy()
    return (logps + np.random.default_rng(4).normal(0, 0.6, logps.shape)).astype(np.float32)


def run_trl(policy, prompt, completion, mask, sampler, options, tmp_path, tokenizer):
    """TRL's loss, gradient norm and logged metrics, its batch scored by its own code."""
    lengths = mask.sum(1)

    def rollout(prompts, trainer):
        return {
            "prompt_ids": prompt.tolist(),
            "completion_ids": [completion[i, : lengths[i]].tolist() for i in range(B)],
            "logprobs": [sampler[i, : lengths[i]].tolist() for i in range(B)],
        }

    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, num_generations=G,
        max_completion_length=C, use_cpu=True, report_to=[], bf16=False,
        vllm_importance_sampling_correction=True, **TRL_PINNED, **options,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, attn_implementation="eager")
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: REWARDS.tolist(),
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": "1 + 2"}] * B),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    # What TRL's correction reads: its completions come from the rollout_func, not vLLM.
    trainer.use_vllm = True
    trainer._last_loaded_step = trainer.state.global_step
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": "1 + 2"}] * B)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grad = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters()))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return float(loss.detach()), float(grad), metrics


def run_jaxtrain(policy, prompt, completion, mask, sampler, options, tmp_path):
    """jaxtrain's loss, gradient norm and logged values: the round's measurement from its
    own trainer log-probs, then the objective on the batch it makes."""
    args = GRPOArguments(
        output_dir=str(tmp_path / "jt"), total_batch_size=B, num_generations=G,
        max_completion_length=C, max_prompt_length=P, **options,
    )  # fmt: skip
    task = TaskModel(AutoModelForCausalLM.from_pretrained(policy), reference=None)
    ids = jnp.asarray(np.concatenate([prompt, completion], 1))
    labels = np.concatenate([np.full_like(prompt, IGNORE_INDEX), completion], 1)
    labels[:, P:][mask == 0] = IGNORE_INDEX
    labels = jnp.asarray(labels)
    trainer_logps, _ = model_token_logps(task.model, ids, labels, temperature=args.temperature)
    full = np.zeros((B, P + C - 1), np.float32)  # the row's log-probs: the completion's last
    full[:, P - 1 :] = np.where(mask == 1, sampler, 0.0)
    weight, logs = round_agreement(
        trainer_logps, jnp.asarray(full), labels, args.sampler_correction,
        args.sampler_correction_min, args.sampler_correction_max,
    )  # fmt: skip
    advantages, _ = group_advantages(REWARDS, G, "group")
    micro = {
        "input_ids": ids,
        "labels": labels,
        "advantages": jnp.asarray(advantages),
        "sampler_logps": jnp.asarray(full),
        "sampler_weight": weight,
    }
    loss, grad, means = loss_grad_and_means(
        grpo_objective(RunSettings.from_arguments(args)), task, micro
    )
    return loss, grad, {**means, **{k: float(v) for k, v in logs.items()}}


@pytest.mark.parametrize("case", list(CASES))
def test_the_correction_equals_trl(checkpoints, batch, tmp_path, tokenizer, case):  # noqa: F811
    mode, (low, high), extra = CASES[case]
    options = dict(beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0, loss_type="dapo")
    options.update(extra)
    prompt, completion, mask, _ = batch
    policy, _ = checkpoints
    sampler = sampler_logps_of(policy, prompt, completion, options["temperature"])
    trl_options = dict(
        options,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    want_loss, want_grad, want = run_trl(
        policy, prompt, completion, mask, sampler, trl_options, tmp_path, tokenizer
    )
    ours = dict(options, sampler_correction=mode, sampler_correction_min=low,
                sampler_correction_max=high)  # fmt: skip
    loss, grad, got = run_jaxtrain(policy, prompt, completion, mask, sampler, ours, tmp_path)
    # Without an upper bound a weight is exp of a completion's summed log-ratios, up to ~e^3
    # here: it carries each token's float32 rounding (torch vs XLA) into the loss: 2e-5 seen
    # with XLA:CPU's fusion emitters, 5.6e-5 with its legacy ones (the suite's, conftest.py).
    rtol = 1e-5 if high is not None else 1e-4
    np.testing.assert_allclose(loss, want_loss, rtol=rtol, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=rtol)
    names = {"entropy": "entropy", "clip_ratio": "clip_ratio/region_mean"}  # TRL: no KL at beta 0
    names.update({name: name for name in SAMPLING + RATIO})
    for name, trl_name in names.items():
        np.testing.assert_allclose(got[name], want[trl_name], rtol=1e-5, atol=1e-7, err_msg=name)
    # Not vacuous: the bounds act on some, not all, of this batch's weights.
    now = torch_logps(policy, prompt, completion, options["temperature"]).numpy()
    log_raw = np.where(mask == 1, now - sampler, 0.0)
    raw = np.exp(log_raw.sum(-1)) if mode.startswith("sequence") else np.exp(log_raw)[mask == 1]
    outside = np.zeros(raw.shape, bool)
    if low is not None:
        outside |= raw < low
    if high is not None:
        outside |= raw > high
    assert 0 < outside.sum() < raw.size


class Record:
    """The logs, the first state (a copy) and, from step 1, a sampler left on it."""

    def __init__(self):
        self.logs, self.first, self.after_one = [], None, None

    def on_train_start(self, trainer, state):
        self.first = jax.tree.map(jnp.copy, state)

    def on_log(self, trainer, logs, step):
        self.logs.append(dict(logs))

    def on_step_end(self, trainer, state, metrics, step):
        if step == 1:  # the next rounds sample from the first parameters: a stale sampler
            self.after_one = jax.tree.map(jnp.copy, state)
            engine = trainer.train_source.engine
            policy = trainer.program.model_from_state(self.first)
            engine.update_state(nnx.split(policy)[1])
            engine.update_state = lambda state: None


def test_a_run_agrees_to_rounding_and_a_stale_sampler_is_measured_and_corrected(
    tokenizer, tmp_path
):
    record = Record()
    args = tiny_arguments(
        GRPOArguments, tmp_path, max_steps=2, total_batch_size=16, num_generations=4,
        max_prompt_length=8, max_completion_length=4, learning_rate=5e-2, temperature=0.8,
        sampler_correction="token_truncate", sampler_correction_max=1.02, logging_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(),
        reward_funcs=[lambda prompts, completions, **_: [float(len(c)) for c in completions]],
        dataset_train=[{"prompt": f"what is {i} + {i % 3} ?"} for i in range(8)],
        processing_class=tokenizer,
        callbacks=[record],
    )
    trainer.train()
    first, second = record.logs
    # On the trainer's own parameters: float rounding of another attention path, no more.
    assert first["sampling/sampling_logp_difference/max"] < 1e-4
    assert abs(first["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    # On the stale ones: the sampler's log-probs are the first policy's, and the weights
    # correct towards the trainer's (clipped at 1.02 here).
    source = trainer.train_source
    rows = source._round.batch
    mask = np.asarray(rows["labels"])[..., 1:] != IGNORE_INDEX
    stale = np.asarray(source.logps.trainer(source.program, record.first, rows))[mask]
    current = np.asarray(source.logps.trainer(source.program, record.after_one, rows))[mask]
    sampler = np.asarray(rows["sampler_logps"])[mask]
    np.testing.assert_allclose(sampler, stale, atol=2e-5)
    difference = np.abs(current - sampler)
    assert second["sampling/sampling_logp_difference/mean"] > 1e-3
    np.testing.assert_allclose(
        second["sampling/sampling_logp_difference/mean"], difference.mean(), rtol=1e-4
    )
    weight = np.asarray(rows["sampler_weight"])[mask]
    np.testing.assert_allclose(weight, np.minimum(np.exp(current - sampler), 1.02), rtol=1e-4)
    assert weight.max() == pytest.approx(1.02) and weight.min() < 1.0

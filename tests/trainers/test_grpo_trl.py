"""GRPO's loss, KL and clip ratio equal TRL's GRPOTrainer on the same batch, through TRL's own
loss code (`GRPOTrainer._compute_loss`) on the same tiny Llama (one transformers checkpoint,
loaded into both), for the four loss types, beta 0 and 0.04, num_iterations 1 and 2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

trl = pytest.importorskip("trl")

from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.data.collate import IGNORE_INDEX  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.trainers.grpo_loss import group_advantages, grpo_loss  # noqa: E402
from jaxtrain.training.logps import model_token_logps  # noqa: E402

B, P, C, G = 8, 5, 7, 4  # completions, prompt length, completion length, group size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    path = tmp_path_factory.mktemp("grpo_trl") / "hf"
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 64, (B, P))
    completion = rng.integers(5, 64, (B, C))
    lengths = np.array([7, 3, 5, 7, 1, 6, 4, 2])
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int64)
    completion = np.where(mask == 1, completion, 0)  # right-padded with the pad id
    rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.2, np.nan, 0.9])
    advantages, _ = group_advantages(rewards, G, "group")
    return prompt, completion, mask, advantages


def jax_logps(path, prompt, completion, mask) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = np.concatenate([prompt, completion], 1)
    labels = np.concatenate([np.full_like(prompt, IGNORE_INDEX), completion], 1)
    labels[:, P:][mask == 0] = IGNORE_INDEX
    logp, _ = model_token_logps(model, jnp.asarray(ids), jnp.asarray(labels))
    return np.asarray(logp)[:, P - 1 :]  # the C positions predicting the completion


def trl_loss(path, tmp_path, inputs, *, loss_type, beta, tokenizer, kl_ratio_weight=True):
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=C,
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        use_cpu=True,
        report_to=[],
        bf16=False,
        use_bias_correction_kl=kl_ratio_weight,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    prompts = datasets.Dataset.from_list([{"prompt": "1 + 2"}] * B)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
    metrics = trainer._metrics["train"]
    kl = metrics["kl"][-1] if beta else 0.0
    return float(loss), kl, metrics["clip_ratio/region_mean"][-1]


CASES = [
    (loss_type, beta, num_iterations, True)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
    for beta in (0.0, 0.04)
    for num_iterations in (1, 2)
] + [("dapo", 0.04, 2, False), ("grpo", 0.04, 2, False)]  # the plain k3 KL too


@pytest.mark.parametrize("loss_type,beta,num_iterations,kl_ratio_weight", CASES)
def test_loss_kl_and_clip_ratio_equal_trl(
    checkpoint, batch, tmp_path, tokenizer, loss_type, beta, num_iterations, kl_ratio_weight
):
    prompt, completion, mask, advantages = batch
    logps = jax_logps(checkpoint, prompt, completion, mask)
    rng = np.random.default_rng(1)
    # A later iteration: the old log-probs are another policy's, far enough for the clip.
    old = logps + rng.normal(0, 0.3, logps.shape).astype(np.float32) if num_iterations > 1 else None
    ref = (logps + rng.normal(0, 0.2, logps.shape)).astype(np.float32) if beta else None
    as_t = lambda x: torch.as_tensor(np.asarray(x))  # noqa: E731
    inputs = {
        "prompt_ids": as_t(prompt),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": as_t(completion),
        "completion_mask": as_t(mask),
        "advantages": as_t(advantages),
        "num_items_in_batch": as_t(mask.sum()),
    }
    if old is not None:
        inputs["old_per_token_logps"] = as_t(old)
    if ref is not None:
        inputs["ref_per_token_logps"] = as_t(ref)
    want_loss, want_kl, want_clip = trl_loss(
        checkpoint,
        tmp_path,
        inputs,
        loss_type=loss_type,
        beta=beta,
        tokenizer=tokenizer,
        kl_ratio_weight=kl_ratio_weight,
    )
    loss, metrics = grpo_loss(
        jnp.asarray(logps),
        None if old is None else jnp.asarray(old),
        None if ref is None else jnp.asarray(ref),
        jnp.asarray(advantages),
        jnp.asarray(mask),
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=C,
        kl_ratio_weight=kl_ratio_weight,
    )
    # On policy with beta 0 the grpo loss is 0 by construction (zero-sum advantages): atol.
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(float(metrics["clip_ratio"]), want_clip, rtol=1e-5, atol=1e-9)
    if num_iterations > 1:
        assert want_clip > 0.05  # the clip is active in this case


def test_group_advantages_equal_trl_nan_statistics():
    from trl.trainer.utils import nanstd

    rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.2, np.nan, 0.9, 1.0, 1.0, 1.0, 1.0])
    r = torch.as_tensor(rewards)
    mean = torch.nanmean(r.view(-1, G), 1).repeat_interleave(G)
    for scale in ("group", "batch", "none"):
        std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G) if scale != "batch" else nanstd(r)
        want = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
        got, equal = group_advantages(rewards, G, scale)
        np.testing.assert_allclose(got, torch.nan_to_num(want, nan=0.0).numpy(), rtol=1e-5)
    assert equal.tolist() == [False] * 8 + [True] * 4


@pytest.fixture(scope="module")
def reference_checkpoint(checkpoint, tmp_path_factory):
    """Another tiny Llama (other weights): the frozen KL reference."""
    config = transformers.LlamaConfig.from_pretrained(checkpoint)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    path = tmp_path_factory.mktemp("grpo_trl_ref") / "hf"
    hf.save_pretrained(path)
    return path


def torch_logps(path, prompt, completion, temperature):
    """log softmax(logits / temperature) of the completion tokens, as TRL computes them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids = torch.as_tensor(np.concatenate([prompt, completion], 1))
    with torch.no_grad():
        logits = model(ids).logits[:, P - 1 : -1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.as_tensor(completion)[..., None])[
        ..., 0
    ]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_objective_at_temperature_07_equals_trl(
    checkpoint, reference_checkpoint, batch, tmp_path, tokenizer, loss_type
):
    """jaxtrain's GRPO objective (policy and reference log-probs from its own models at the
    sampling temperature) against TRL's `_compute_loss` at temperature 0.7: the loss, its
    gradient's global norm, and the logged KL, clip ratio and entropy (token means)."""
    import jax

    from jaxtrain.rollout_arguments import GRPOArguments
    from jaxtrain.trainers.frozen import TaskModel
    from jaxtrain.trainers.grpo import grpo_objective

    temperature, beta = 0.7, 0.04
    prompt, completion, mask, advantages = batch
    ref = torch_logps(reference_checkpoint, prompt, completion, temperature)
    as_t = lambda x: torch.as_tensor(np.asarray(x))  # noqa: E731
    inputs = {
        "prompt_ids": as_t(prompt),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": as_t(completion),
        "completion_mask": as_t(mask),
        "advantages": as_t(advantages),
        "num_items_in_batch": as_t(mask.sum()),
        "ref_per_token_logps": ref,
    }
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, num_generations=G,
        max_completion_length=C, loss_type=loss_type, beta=beta, epsilon=0.2,
        epsilon_high=0.28, temperature=temperature, use_cpu=True, report_to=[], bf16=False,
    )  # fmt: skip
    policy = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="eager"
    )
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": "1 + 2"}] * B),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    want_grad = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in policy.parameters()))
    metrics = trainer._metrics["train"]

    args = GRPOArguments(
        output_dir=str(tmp_path / "jt"), loss_type=loss_type, beta=beta, epsilon=0.2,
        epsilon_high=0.28, temperature=temperature, total_batch_size=B, num_generations=G,
        max_completion_length=C, max_prompt_length=P,
    )  # fmt: skip
    objective = grpo_objective(RunSettings.from_arguments(args))
    task = TaskModel(
        AutoModelForCausalLM.from_pretrained(checkpoint),
        reference=AutoModelForCausalLM.from_pretrained(reference_checkpoint),
    )
    labels = np.concatenate([np.full_like(prompt, IGNORE_INDEX), completion], 1)
    labels[:, P:][mask == 0] = IGNORE_INDEX
    micro = {
        "input_ids": jnp.asarray(np.concatenate([prompt, completion], 1)),
        "labels": jnp.asarray(labels),
        "advantages": jnp.asarray(advantages),
    }
    from flax import nnx

    graphdef, params, rest = nnx.split(task, nnx.Param, ...)

    def loss_of(params):
        sums = objective.loss_sums(nnx.merge(graphdef, params, rest), micro, None)
        return sums["loss_sum"] / objective.normalizer(jax.tree.map(lambda x: x[None], micro)), sums

    (got, sums), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    got_grad = float(
        jnp.sqrt(sum((g.astype(jnp.float32) ** 2).sum() for g in jax.tree.leaves(grads)))
    )
    np.testing.assert_allclose(float(got), float(loss.detach()), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got_grad, float(want_grad), rtol=1e-5)
    for key, trl_key in (
        ("kl", "kl"),
        ("clip_ratio", "clip_ratio/region_mean"),
        ("entropy", "entropy"),
    ):
        value = float(sums[f"{key}_sum"]) / float(sums[f"{key}_count"])
        np.testing.assert_allclose(value, metrics[trl_key][-1], rtol=1e-5, atol=1e-8)

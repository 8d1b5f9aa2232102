"""TRL 1.16's newer GRPO objectives equal TRL's GRPOTrainer on the same batch, through TRL's
own loss code (`GRPOTrainer._compute_loss`) and jaxtrain's objective (`grpo_objective`, its
log-probs from its own models) on the same tiny Llamas: sequence-level importance sampling
(GSPO), the cispo and sapo losses and the off-policy sequence mask. Loss, gradient norm and
the logged KL, clip ratio (cispo_clip_ratio for cispo; none for sapo) and entropy, rel 1e-5.
TRL's defaults that would change these numbers are pinned in its config."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

trl = pytest.importorskip("trl")

from jaxtrain.arguments import ArgumentError  # noqa: E402
from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.data.collate import IGNORE_INDEX  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.rollout_arguments import GRPOArguments  # noqa: E402
from jaxtrain.trainers.frozen import TaskModel  # noqa: E402
from jaxtrain.trainers.grpo import grpo_objective  # noqa: E402
from jaxtrain.trainers.grpo_loss import (  # noqa: E402
    group_advantages,
    grpo_loss,
    grpo_loss_sums,
    grpo_normalizer,
)

B, P, C, G = 8, 5, 7, 4  # completions, prompt length, completion length, group size


def tiny_llama(seed: int, path):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
        pad_token_id=0, eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(policy, KL reference): two tiny Llamas of other weights."""
    root = tmp_path_factory.mktemp("grpo_trl_objectives")
    return tiny_llama(0, root / "policy"), tiny_llama(1, root / "reference")


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 64, (B, P))
    completion = rng.integers(5, 64, (B, C))
    lengths = np.array([7, 3, 5, 7, 1, 6, 4, 2])
    mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int64)
    completion = np.where(mask == 1, completion, 0)  # right-padded with the pad id
    rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.7, np.nan, 0.9])
    advantages, _ = group_advantages(rewards, G, "group")
    return prompt, completion, mask, advantages


def torch_logps(path, prompt, completion, temperature):
    """log softmax(logits / temperature) of the completion tokens, as TRL computes them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    ids = torch.as_tensor(np.concatenate([prompt, completion], 1))
    with torch.no_grad():
        logits = model(ids).logits[:, P - 1 : -1] / temperature
    logps = torch.log_softmax(logits.float(), -1)
    return logps.gather(-1, torch.as_tensor(completion)[..., None])[..., 0]


def old_logps_of(policy, prompt, completion, temperature) -> np.ndarray:
    """A later iteration's old log-probs: another policy's, off by a shift per completion
    (moves a sequence-level ratio out of the clip range) and per token."""
    logps = torch_logps(policy, prompt, completion, temperature).numpy()
    rng = np.random.default_rng(1)
    shift = rng.normal(0, 0.35, (B, 1)) + rng.normal(0, 0.2, logps.shape)
    return (logps + shift).astype(np.float32)


# What each case sets beyond the pinned defaults below. "old": a later iteration (old
# log-probs of another policy: clip, cap, gate and mask act); else on-policy.
CASES = {
    "gspo_grpo": dict(loss_type="grpo", importance_sampling_level="sequence", old=True),
    "gspo_grpo_on_policy": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "gspo_dapo": dict(loss_type="dapo", importance_sampling_level="sequence", old=True),
    "gspo_dr_grpo_t07": dict(
        loss_type="dr_grpo", importance_sampling_level="sequence", old=True, temperature=0.7
    ),
    "cispo_trl_recommended": dict(loss_type="cispo", epsilon_high=5.0, old=True),
    "cispo_cap_active": dict(loss_type="cispo", epsilon_high=1.1, old=True),
    "cispo_sequence": dict(
        loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence", old=True
    ),
    "cispo_on_policy": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo_defaults": dict(loss_type="sapo", old=True),
    "sapo_temperatures": dict(
        loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, old=True
    ),
    "sapo_sequence_t07": dict(
        loss_type="sapo", importance_sampling_level="sequence", old=True, temperature=0.7
    ),
    "opsm_dapo": dict(loss_type="dapo", off_policy_mask_threshold=0.05, old=True),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence", old=True),
    "luspo_token_t07": dict(loss_type="luspo", old=True, temperature=0.7),
    "delta_dapo": dict(loss_type="dapo", delta=1.5, old=True),
    "delta_gspo_grpo": dict(
        loss_type="grpo", importance_sampling_level="sequence", delta=1.3, old=True
    ),
    "vespo_defaults": dict(loss_type="vespo", old=True),
    "vespo_on_policy": dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_neg=4.0),
    "vespo_params_t07": dict(
        loss_type="vespo", vespo_k_neg=1.5, vespo_lambda_pos=2.0, old=True, temperature=0.7
    ),
    "opsm_gspo_sapo": dict(
        loss_type="sapo",
        importance_sampling_level="sequence",
        off_policy_mask_threshold=0.05,
        old=True,
    ),  # fmt: skip
}
# TRL's defaults (1.16) that change these numbers, pinned: a new TRL default must not pass
# unnoticed.
PINNED = dict(
    beta=0.04, epsilon=0.2, epsilon_high=0.28, temperature=1.0, importance_sampling_level="token",
    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, off_policy_mask_threshold=None,
    delta=None, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
)  # fmt: skip
TRL_PINNED = dict(
    use_bias_correction_kl=True, top_entropy_quantile=1.0, entropy_coef=0.0,
    use_adaptive_entropy=False, use_vllm=False, num_iterations=1, scale_rewards="group",
    mask_truncated_completions=False,
)  # fmt: skip


def run_trl(policy, inputs, options, tmp_path, tokenizer):
    """TRL's loss, gradient norm and logged metrics of `inputs`."""
    config = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, num_generations=G,
        max_completion_length=C, use_cpu=True, report_to=[], bf16=False,
        **TRL_PINNED, **options,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(policy, attn_implementation="eager")
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": "1 + 2"}] * B),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grad = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters()))
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    return float(loss.detach()), float(grad), metrics


def run_jaxtrain(checkpoints, prompt, completion, mask, advantages, old, options, tmp_path):
    """jaxtrain's loss, gradient norm and logged means (sum / count) through grpo_objective."""
    args = GRPOArguments(
        output_dir=str(tmp_path / "jt"), total_batch_size=B, num_generations=G,
        max_completion_length=C, max_prompt_length=P, kl_ratio_weight=True, **options,
    )  # fmt: skip
    objective = grpo_objective(RunSettings.from_arguments(args))
    policy, reference = checkpoints
    task = TaskModel(
        AutoModelForCausalLM.from_pretrained(policy),
        reference=AutoModelForCausalLM.from_pretrained(reference),
    )
    labels = np.concatenate([np.full_like(prompt, IGNORE_INDEX), completion], 1)
    labels[:, P:][mask == 0] = IGNORE_INDEX
    micro = {
        "input_ids": jnp.asarray(np.concatenate([prompt, completion], 1)),
        "labels": jnp.asarray(labels),
        "advantages": jnp.asarray(advantages),
    }
    if old is not None:  # the log-probs are over the whole row: the completion's are the last C
        full = np.zeros((B, P + C - 1), np.float32)
        full[:, P - 1 :] = old
        micro["old_logps"] = jnp.asarray(full)
    return loss_grad_and_means(objective, task, micro)


def loss_grad_and_means(objective, task, micro) -> tuple[float, float, dict[str, float]]:
    """The objective's loss of one micro-batch (over its normalizer), its gradient norm, and
    each logged mean (sum / count)."""
    graphdef, params, rest = nnx.split(task, nnx.Param, ...)

    def loss_of(params):
        sums = objective.loss_sums(nnx.merge(graphdef, params, rest), micro, None)
        return sums["loss_sum"] / objective.normalizer(jax.tree.map(lambda x: x[None], micro)), sums

    (loss, sums), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    grad = jnp.sqrt(sum((g.astype(jnp.float32) ** 2).sum() for g in jax.tree.leaves(grads)))
    means = {
        key[: -len("_sum")]: float(value) / float(sums[key[: -len("_sum")] + "_count"])
        for key, value in sums.items()
        if key.endswith("_sum") and key != "loss_sum"
    }
    return float(loss), float(grad), means


@pytest.mark.parametrize("case", list(CASES))
def test_objective_equals_trl(checkpoints, batch, tmp_path, tokenizer, case):
    options = {**PINNED, **CASES[case]}
    later = options.pop("old", False)
    prompt, completion, mask, advantages = batch
    policy, reference = checkpoints
    t = options["temperature"]
    old = old_logps_of(policy, prompt, completion, t) if later else None
    as_t = lambda x: torch.as_tensor(np.asarray(x))  # noqa: E731
    inputs = {
        "prompt_ids": as_t(prompt),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": as_t(completion),
        "completion_mask": as_t(mask),
        "advantages": as_t(advantages),
        "num_items_in_batch": as_t(mask.sum()),
        "ref_per_token_logps": torch_logps(reference, prompt, completion, t),
    }
    if old is not None:
        inputs["old_per_token_logps"] = as_t(old)
    if options["off_policy_mask_threshold"] is not None:  # the mask drops some completions
        now = torch_logps(policy, prompt, completion, t).numpy()
        drift = ((old - now) * mask).sum(-1) / np.maximum(mask.sum(-1), 1)
        dropped = (advantages < 0) & (drift > options["off_policy_mask_threshold"])
        assert 0 < dropped.sum() < B
    want_loss, want_grad, want = run_trl(policy, inputs, options, tmp_path, tokenizer)
    loss, grad, got = run_jaxtrain(
        checkpoints, prompt, completion, mask, advantages, old, options, tmp_path
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5)
    loss_type = options["loss_type"]
    clip = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}.get(loss_type, "clip_ratio")
    trl_names = {"kl": "kl", "entropy": "entropy"}
    if loss_type == "vespo":  # its weight instead of a clip ratio
        trl_names["vespo/phi_seq_mean"] = "vespo/phi_seq_mean"
    if clip is not None:
        trl_names[clip] = "clip_ratio/region_mean" if clip == "clip_ratio" else clip
    assert set(got) == set(trl_names), got  # sapo logs no clip ratio, cispo its own
    for name, trl_name in trl_names.items():
        np.testing.assert_allclose(got[name], want[trl_name], rtol=1e-5, atol=1e-8, err_msg=name)
    assert "clip_ratio/region_mean" not in want or clip == "clip_ratio"
    if later and clip is not None and options.get("epsilon_high") != 5.0:
        assert want[trl_names[clip]] > 0.05  # the clip (or cispo's cap) is active here


def surrogate_inputs(seed: int = 2):
    rng = np.random.default_rng(seed)
    logps = jnp.asarray(rng.normal(-2.0, 0.5, (B, C)), jnp.float32)
    old = logps + jnp.asarray(rng.normal(0, 0.35, (B, 1)) + rng.normal(0, 0.2, (B, C)), jnp.float32)
    mask = jnp.asarray(np.arange(C)[None] < np.array([7, 3, 5, 7, 1, 6, 4, 2])[:, None])
    rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.2, 0.7, 0.3, 0.9])
    advantages = jnp.asarray(group_advantages(rewards, G, "group")[0])
    return logps, old, mask, advantages


def test_off_policy_mask_drops_the_drifted_negative_completions_only():
    """The mask acts in this batch (the loss moves) and equals a hand-made one: the policy
    term of a completion of negative advantage whose mean old - logp > delta is dropped."""
    logps, old, mask, advantages = surrogate_inputs()
    delta = 0.05
    common = dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)
    masked, _ = grpo_loss(logps, old, None, advantages, mask, off_policy_mask_threshold=delta,
                          **common)  # fmt: skip
    drift = ((old - logps) * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)
    keep = (advantages >= 0) | (drift <= delta)
    assert 0 < int((~keep).sum()) < B  # some, not all, completions are dropped here
    by_hand, _ = grpo_loss(logps, old, None, advantages * keep, mask, **common)
    plain, _ = grpo_loss(logps, old, None, advantages, mask, **common)
    # A dropped completion's term is 0, as if its advantage were 0; the token count is kept.
    np.testing.assert_allclose(float(masked), float(by_hand), rtol=1e-6)
    assert abs(float(masked) - float(plain)) > 1e-3


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_accumulated_sums_equal_the_one_batch_loss(loss_type, level):
    """Two micro-batches' sums over the update's normalizer equal the loss of the whole batch
    (cispo, vespo: over every completion token of the update, as dapo; sapo: per completion,
    as grpo; luspo: each completion's sum, per completion)."""
    logps, old, mask, advantages = surrogate_inputs()
    options = dict(beta=0.0, epsilon=0.2, epsilon_high=1.1, importance_sampling_level=level)
    whole, _ = grpo_loss(logps, old, None, advantages, mask, loss_type=loss_type,
                         max_completion_length=C, **options)  # fmt: skip
    halves = [slice(0, B // 2), slice(B // 2, B)]
    sums = [
        grpo_loss_sums(logps[s], old[s], None, advantages[s], mask[s], loss_type=loss_type,
                       max_completion_length=C, **options)["loss_sum"]
        for s in halves
    ]  # fmt: skip
    normalizer = grpo_normalizer(loss_type, mask.reshape(2, B // 2, C))
    np.testing.assert_allclose(float(sum(sums) / normalizer), float(whole), rtol=1e-6)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("importance_sampling_level", "sentence", "importance_sampling_level='sentence'"),
        ("loss_type", "gspo", "loss_type='gspo'"),
        ("delta", 1.1, "delta=1.1 must be None"),
        ("sapo_temperature_pos", -1.0, "sapo_temperature_pos=-1.0 must be > 0"),
        ("sapo_temperature_neg", 0.0, "sapo_temperature_neg=0.0 must be > 0"),
        ("off_policy_mask_threshold", -0.1, "off_policy_mask_threshold=-0.1"),
    ],
)
def test_new_fields_are_checked_by_name(tmp_path, field, value, match):
    with pytest.raises(ArgumentError, match=f"GRPOArguments.{match}"):
        GRPOArguments(output_dir=str(tmp_path), **{field: value})


def test_cispo_needs_a_positive_cap(tmp_path):
    with pytest.raises(ArgumentError, match="GRPOArguments.epsilon_high=0.0: with loss_type='cis"):
        GRPOArguments(output_dir=str(tmp_path), loss_type="cispo", epsilon_high=0.0)
    assert GRPOArguments(output_dir=str(tmp_path), loss_type="cispo").epsilon_high == 0.2


class Logs:
    def __init__(self):
        self.logs: list[dict[str, float]] = []

    def on_log(self, trainer, logs, step):
        self.logs.append(dict(logs))


def first_is_big(prompts, completions, **_):
    return [float(bool(c.split()) and c.split()[0] in {"10", "11", "12"}) for c in completions]


@pytest.mark.parametrize(
    "options, clip",
    [
        (dict(loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence",
              off_policy_mask_threshold=0.0), "cispo_clip_ratio"),
        (dict(loss_type="sapo", sapo_temperature_pos=0.5), None),
        (dict(loss_type="grpo", importance_sampling_level="sequence"), "clip_ratio"),
    ],
)  # fmt: skip
def test_the_trainer_runs_and_logs_each_objective(tokenizer, tmp_path, options, clip):
    """GRPOTrainer with the new options (two updates per round: old log-probs, the cap and the
    mask compiled in): finite losses, and the clip metric TRL logs for the loss type only."""
    from trainer_fixtures import tiny_arguments, tiny_model

    from jaxtrain.trainers import GRPOTrainer

    logs = Logs()
    args = tiny_arguments(
        GRPOArguments, tmp_path, max_steps=2, total_batch_size=8, num_generations=4,
        max_prompt_length=8, max_completion_length=3, num_iterations=2, beta=0.04, **options,
    )  # fmt: skip
    rows = [{"prompt": f"what is {i % 7} + {(3 * i) % 5} ?"} for i in range(8)]
    GRPOTrainer(
        arguments=args, model=tiny_model(), reward_funcs=[first_is_big], dataset_train=rows,
        processing_class=tokenizer, callbacks=[logs],
    ).train()  # fmt: skip
    assert len(logs.logs) == 2
    for entry in logs.logs:
        assert np.isfinite(entry["loss"]) and np.isfinite(entry["kl"])
        named = {k for k in entry if "clip_ratio" in k and not k.startswith("completions/")}
        assert named == ({clip} if clip else set()), entry
        if clip:
            assert 0.0 <= entry[clip] <= 1.0

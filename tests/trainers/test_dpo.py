"""DPOTrainer: ln 2 at step 0, hand-computed losses, reference log-probs against
transformers, and a tiny model learning a synthetic preference set."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model

from jaxtrain.data.errors import DatasetError
from jaxtrain.hf import AutoModelForCausalLM
from jaxtrain.trainers import DPOArguments, DPOTrainer, dpo_losses, reference_logps
from jaxtrain.trainers.data import PairCollator, PairFeaturizer
from jaxtrain.training.logps import token_logps


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def hand_logps(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Sum over t of log softmax(logits[t])[labels[t + 1]] where labels[t + 1] != -100."""
    out = np.zeros(len(logits))
    for b in range(len(logits)):
        for t in range(logits.shape[1] - 1):
            if labels[b, t + 1] != -100:
                out[b] += log_softmax(logits[b, t])[labels[b, t + 1]]
    return out


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_losses_equal_a_hand_computation(loss_type):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 5, 7)).astype(np.float32)  # chosen 0-1, rejected 2-3, per side
    ref_logits = rng.normal(size=(4, 5, 7)).astype(np.float32)
    labels = rng.integers(0, 7, (4, 5))
    labels[:, :2] = -100  # the prompt
    labels[1, 4] = -100  # a shorter response
    logp = hand_logps(logits, labels)
    ref = hand_logps(ref_logits, labels)
    lp, mask = token_logps(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_allclose(np.asarray(lp.sum(-1)), logp, rtol=1e-5)
    beta, eps = 0.3, (0.1 if loss_type == "sigmoid" else 0.0)
    h = (logp[:2] - ref[:2]) - (logp[2:] - ref[2:])
    expected = {
        "sigmoid": -(1 - eps) * np.log(1 / (1 + np.exp(-beta * h)))
        - eps * np.log(1 / (1 + np.exp(beta * h))),
        "ipo": (h - 1 / (2 * beta)) ** 2,
        "hinge": np.maximum(0.0, 1 - beta * h),
    }[loss_type]
    got = dpo_losses(
        *(jnp.asarray(x) for x in (logp[:2], logp[2:], ref[:2], ref[2:])),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=eps,
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


@pytest.fixture(scope="module")
def trained(tokenizer, tmp_path_factory):
    """One DPO run on the synthetic set (the reference: a frozen copy of the start)."""
    rows = datasets.Dataset.from_list(addition_pairs(16))
    seen = StepMetrics()
    args = tiny_arguments(
        DPOArguments, tmp_path_factory.mktemp("dpo"), max_steps=12, beta=0.5, logging_steps=4
    )
    trainer = DPOTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=rows,
        dataset_eval=rows,
        processing_class=tokenizer,
        callbacks=[seen],
    )
    out = trainer.train()
    return trainer, out, seen


def test_step_zero_is_ln2_with_zero_rewards(trained):
    _, _, seen = trained
    first = seen.steps[0]
    assert first["tokens"] == 8  # pairs
    assert first["loss_sum"] / first["tokens"] == pytest.approx(math.log(2), abs=1e-6)
    for key in ("rewards/chosen_sum", "rewards/rejected_sum", "rewards/margins_sum"):
        assert first[key] == pytest.approx(0.0, abs=1e-6), key
    assert first["logps/chosen_sum"] < 0 and first["logps/rejected_sum"] < 0


def test_the_start_up_memory_counts_the_reference(trained):
    """The start-up line and run_info.json once left frozen weights out (a reference, a QLoRA
    base), which `jaxtrain plan` counts: here the reference is a copy of the policy."""
    import json

    trainer, _, _ = trained
    info = json.loads((Path(trainer.arguments.output_dir) / "run_info.json").read_text())
    memory = info["startup"]["memory_per_device_bytes"]
    assert memory["frozen"] == memory["parameters"] > 0
    assert (
        memory["total"] >= 2 * memory["parameters"] + memory["optimizer_state"] + memory["frozen"]
    )


def test_a_bfloat16_policy_starts_equal_to_its_reference(tokenizer, tmp_path):
    """param_dtype applies to the frozen reference too: were it kept in float32 beside a
    bfloat16 policy, step 0's rewards would be the rounding of the policy, not 0."""
    seen = StepMetrics()
    args = tiny_arguments(
        DPOArguments, tmp_path, max_steps=1, beta=0.5, param_dtype="bfloat16", logging_steps=1
    )
    trainer = DPOTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=datasets.Dataset.from_list(addition_pairs(8)),
        processing_class=tokenizer,
        callbacks=[seen],
    )
    frozen = jax.tree.leaves(trainer.program.frozen_state())
    assert frozen and {x.dtype for x in frozen if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype("bfloat16")
    }
    trainer.train()
    first = seen.steps[0]
    for key in ("rewards/chosen_sum", "rewards/rejected_sum", "rewards/margins_sum"):
        assert first[key] == 0.0, key
    assert first["loss_sum"] / first["tokens"] == pytest.approx(math.log(2), abs=1e-6)


def test_synthetic_preferences_reach_reward_accuracy(trained):
    trainer, out, seen = trained
    assert seen.steps[-1]["loss_sum"] < seen.steps[0]["loss_sum"]
    assert out.metrics["eval/accuracy"] > 0.9  # rewards/accuracies over every pair
    # The objective's extra sums reach metrics.jsonl as per-pair means, in training and eval.
    text = Path(trainer.arguments.output_dir, "metrics.jsonl").read_text()
    logs = [json.loads(line) for line in text.splitlines()]
    train_logs = [entry for entry in logs if "rewards/margins" in entry]
    assert train_logs and train_logs[-1]["rewards/margins"] > 0
    assert train_logs[-1]["rewards/accuracies"] == pytest.approx(train_logs[-1]["accuracy"])
    assert out.metrics["eval/rewards/accuracies"] > 0.9
    # The reference stayed frozen: not in the train state, not in the optimizer state.
    assert trainer.model.reference is not None
    assert trainer.num_parameters == sum(
        x.size for x in __import__("jax").tree.leaves(out.state.params)
    )


def test_reference_logps_equal_transformers(tmp_path, tokenizer):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.eval().save_pretrained(tmp_path / "hf")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    rows = addition_pairs(5)
    got = reference_logps(ours, rows, tokenizer=tokenizer, max_length=16, batch_size=4)
    featurizer = PairFeaturizer(name="pairs", tokenizer=tokenizer, max_length=16)
    featurizer.detect(rows[0])
    batch = PairCollator(16, tokenizer.pad_token_id)(featurizer(rows, range(5)))
    for side, prefix in (("chosen", ""), ("rejected", "rejected_")):
        ids, labels = batch[f"{prefix}input_ids"], batch[f"{prefix}labels"]
        with torch.no_grad():
            logits = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
        expected = hand_logps(logits, labels)
        np.testing.assert_allclose(got[f"reference_{side}_logps"], expected, rtol=1e-4, atol=1e-4)


def test_precomputed_reference_logps_replace_the_reference(tokenizer, tmp_path):
    rows = datasets.Dataset.from_list(addition_pairs(8))
    seen = StepMetrics()
    args = tiny_arguments(
        DPOArguments, tmp_path, max_steps=1, precompute_reference_logps=True, logging_steps=1
    )
    trainer = DPOTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=rows,
        processing_class=tokenizer,
        callbacks=[seen],
    )
    assert trainer.model.reference is None
    assert "reference_chosen_logps" in trainer.dataset_train.column_names
    trainer.train()
    assert seen.steps[0]["loss_sum"] / seen.steps[0]["tokens"] == pytest.approx(
        math.log(2), abs=1e-5
    )


def test_bad_pairs_name_the_row_and_column(tokenizer, tmp_path):
    rows = addition_pairs(8)
    missing = [
        {"prompt": r["prompt"], "answer": r["chosen"], "rejected": r["rejected"]} for r in rows
    ]
    with pytest.raises(DatasetError, match="no column 'chosen'.*available columns"):
        DPOTrainer(
            arguments=tiny_arguments(DPOArguments, tmp_path),
            model=tiny_model(),
            dataset_train=missing,
            processing_class=tokenizer,
        )
    featurizer = PairFeaturizer(name="dataset_train", tokenizer=tokenizer, max_length=16)
    featurizer.detect(rows[0])
    rows[3] = {**rows[3], "rejected": ""}
    with pytest.raises(DatasetError, match="row 3: column 'rejected' is empty"):
        featurizer(rows, range(8))


def test_the_prompt_is_truncated_and_the_response_kept(tokenizer):
    featurizer = PairFeaturizer(name="pairs", tokenizer=tokenizer, max_length=6)
    row = {"prompt": "what is 1 + 2 + 3 + 4 ?", "chosen": "10", "rejected": "11 12"}
    featurizer.detect(row)
    (pair,) = featurizer([row], [0])
    chosen = tokenizer.convert_ids_to_tokens(pair["chosen_input_ids"].tolist())
    rejected = tokenizer.convert_ids_to_tokens(pair["rejected_input_ids"].tolist())
    assert chosen == ["+", "3", "+", "4", "?", "10", "</s>"][-6:]
    assert rejected == ["+", "4", "?", "11", "12", "</s>"]
    assert (pair["rejected_labels"][:3] == -100).all() and (pair["rejected_labels"][3:] >= 0).all()

"""KTO, ORPO and CPO/SimPO equal TRL 1.16's trainers on the same batch, through TRL's own loss
code (`KTOTrainer._compute_loss`, `ORPOTrainer.get_batch_loss_metrics`,
`CPOTrainer.get_batch_loss_metrics`) on the same tiny Llama checkpoint loaded into both: the
loss, every metric both log, and the gradient (its global norm and the embedding's)."""

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
from trainer_fixtures import addition_pairs

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM  # noqa: E402
from jaxtrain.objective import summarize_sums  # noqa: E402
from jaxtrain.trainers import CPOArguments, KTOArguments, ORPOArguments  # noqa: E402
from jaxtrain.trainers.cpo import cpo_objective  # noqa: E402
from jaxtrain.trainers.data import PairCollator, PairFeaturizer  # noqa: E402
from jaxtrain.trainers.frozen import TaskModel  # noqa: E402
from jaxtrain.trainers.kto import kto_objective  # noqa: E402
from jaxtrain.trainers.kto_data import (  # noqa: E402
    KTOCollator,
    KTOFeaturizer,
    rotated,
    unpair_preferences,
)
from jaxtrain.trainers.orpo import orpo_objective  # noqa: E402

T = 16  # max_sequence_length
RTOL = 1e-5


def hf_checkpoint(path, seed: int):
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
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_trl")
    return hf_checkpoint(root / "policy", 0), hf_checkpoint(root / "reference", 1)


def uneven_pairs(n: int = 8) -> list[dict[str, str]]:
    """Pairs whose chosen and rejected differ in length (and prompts too)."""
    rows = addition_pairs(n)
    for i, row in enumerate(rows):
        row["rejected"] = " ".join([row["rejected"]] * (1 + i % 3))
        row["prompt"] = ("what is " * (i % 2)) + row["prompt"]
    return rows


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.float().eval()


def torch_grad_norms(model) -> tuple[float, np.ndarray]:
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
    return norm, model.get_input_embeddings().weight.grad.numpy()


def jax_loss_and_grads(objective, task_model: TaskModel, batch: dict[str, np.ndarray]):
    """(log values of the objective's sums, global grad norm, the embedding's gradient) of
    the batch as one global batch of one micro-batch, as the train step computes them."""
    graphdef, params, rest = nnx.split(task_model, nnx.Param, ...)
    micro = {k: jnp.asarray(v) for k, v in batch.items()}
    global_batch = {k: v[None] for k, v in micro.items()}
    normalizer = jnp.maximum(objective.normalizer(global_batch), 1.0)
    if objective.global_scalars is not None:
        micro = {**micro, **objective.global_scalars(global_batch)}

    def loss(params):
        sums = objective.loss_sums(nnx.merge(graphdef, params, rest), micro, jax.random.key(0))
        return sums["loss_sum"] / normalizer, sums

    grads, sums = jax.jit(jax.grad(loss, has_aux=True))(params)
    logs = summarize_sums(
        {k: float(v) for k, v in sums.items()}, perplexity=False, differences=objective.differences
    )
    norm = float(
        np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    )
    embedding = np.asarray(grads["model"]["model"]["embed_tokens"]["embedding"][...])
    return logs, norm, embedding


def assert_same(ours: dict[str, float], theirs: dict[str, float], keys, what: str):
    if os.environ.get("JAXTRAIN_SHOW_PARITY"):  # the measured differences, for the record
        rel = {k: abs(ours[k] - theirs[k]) / max(abs(theirs[k]), 1e-12) for k in keys}
        print(what, {k: f"{v:.1e}" for k, v in rel.items()})
    for key in keys:
        np.testing.assert_allclose(
            ours[key], theirs[key], rtol=RTOL, atol=1e-7, err_msg=f"{what}: {key}"
        )


# --------------------------------------------------------------------------- pairs: ORPO, CPO
@pytest.fixture(scope="module")
def pair_batch(tokenizer):
    rows = uneven_pairs()
    featurizer = PairFeaturizer(name="pairs", tokenizer=tokenizer, max_length=T)
    featurizer.detect(rows[0])
    batch = PairCollator(T, tokenizer.pad_token_id)(featurizer(rows, range(len(rows))))
    lengths = batch["attention_mask"].sum(1), batch["rejected_attention_mask"].sum(1)
    assert len(set(lengths[0])) > 1 and (lengths[0] != lengths[1]).any()  # uneven
    return rows, batch


def torch_pair_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    out = {}
    for side, prefix in (("chosen", ""), ("rejected", "rejected_")):
        for key in ("input_ids", "attention_mask", "labels"):
            out[f"{side}_{key}"] = torch.as_tensor(batch[f"{prefix}{key}"], dtype=torch.long)
    return out


def trl_pair_loss(trainer_cls, config, path, rows, tokenizer, batch):
    model = hf_model(path)
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    trainer.model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, torch_pair_batch(batch))
    loss.backward()
    return loss.item(), metrics, *torch_grad_norms(trainer.model)


def trl_config(cls, tmp_path, **kwargs):
    return cls(
        output_dir=str(tmp_path / "trl"),
        max_length=T,
        per_device_train_batch_size=8,
        use_cpu=True,
        bf16=False,
        report_to=[],
        **kwargs,
    )


def assert_grads(our_norm, norm, our_embedding, embedding):
    if os.environ.get("JAXTRAIN_SHOW_PARITY"):
        scale = np.abs(embedding).max()
        print("grad norm rel", f"{abs(our_norm - norm) / norm:.1e}", "embedding max diff / max",
              f"{np.abs(our_embedding - embedding).max() / scale:.1e}")  # fmt: skip
    np.testing.assert_allclose(our_norm, norm, rtol=RTOL)
    # Element by element, to the tensor's scale (one small entry may be a cancellation).
    scale = np.abs(embedding).max()
    np.testing.assert_allclose(our_embedding, embedding, rtol=0, atol=RTOL * scale)


PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def test_orpo_equals_trl(checkpoints, pair_batch, tokenizer, tmp_path):
    rows, batch = pair_batch
    beta = 0.25
    loss, metrics, norm, embedding = trl_pair_loss(
        ORPOTrainer,
        trl_config(ORPOConfig, tmp_path, beta=beta),
        checkpoints[0],
        rows,
        tokenizer,
        batch,
    )
    objective = orpo_objective(
        RunSettings.from_arguments(ORPOArguments(beta=beta, max_sequence_length=T))
    )
    ours = TaskModel(AutoModelForCausalLM.from_pretrained(checkpoints[0]))
    logs, our_norm, our_embedding = jax_loss_and_grads(objective, ours, batch)
    assert_same(logs, {"loss": loss}, ("loss",), "loss")
    assert_same(
        logs, metrics, (*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"), "orpo"
    )
    assert_grads(our_norm, norm, our_embedding, embedding)


CPO_CASES = {
    "cpo_sigmoid": dict(loss_type="sigmoid", cpo_alpha=1.0, label_smoothing=0.1),
    "simpo": dict(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.8, beta=2.0),
    "cpo_simpo": dict(loss_type="simpo", cpo_alpha=0.5, simpo_gamma=0.3, beta=2.0),
    "ipo": dict(loss_type="ipo", cpo_alpha=1.0),
    "hinge": dict(loss_type="hinge", cpo_alpha=1.0),
}


@pytest.mark.parametrize("case", list(CPO_CASES))
def test_cpo_and_simpo_equal_trl(checkpoints, pair_batch, tokenizer, tmp_path, case):
    rows, batch = pair_batch
    kwargs = {"beta": 0.5, **CPO_CASES[case]}
    loss, metrics, norm, embedding = trl_pair_loss(
        CPOTrainer,
        trl_config(CPOConfig, tmp_path, **kwargs),
        checkpoints[0],
        rows,
        tokenizer,
        batch,
    )
    objective = cpo_objective(
        RunSettings.from_arguments(CPOArguments(max_sequence_length=T, **kwargs))
    )
    ours = TaskModel(AutoModelForCausalLM.from_pretrained(checkpoints[0]))
    logs, our_norm, our_embedding = jax_loss_and_grads(objective, ours, batch)
    assert_same(logs, {"loss": loss}, ("loss",), "loss")
    keys = (*PAIR_METRICS, "nll_loss") if kwargs["cpo_alpha"] else PAIR_METRICS
    assert_same(logs, metrics, keys, case)
    assert ("nll_loss" in logs) == bool(kwargs["cpo_alpha"])
    assert_grads(our_norm, norm, our_embedding, embedding)
    if case == "simpo":  # the margin gamma moved the loss: it is not the gamma-free one
        free = cpo_objective(
            RunSettings.from_arguments(
                CPOArguments(max_sequence_length=T, **{**kwargs, "simpo_gamma": 0})
            )
        )
        assert jax_loss_and_grads(free, ours, batch)[0]["loss"] < logs["loss"] - 0.1


# --------------------------------------------------------------------------------------- KTO
# Unbalanced: 5 desirable, 3 undesirable examples.
KTO_LABELS = [True, True, False, True, True, False, True, False]


@pytest.fixture(scope="module")
def kto_rows():
    rows = uneven_pairs()
    return [
        {"prompt": r["prompt"], "completion": r["chosen"] if good else r["rejected"], "label": good}
        for r, good in zip(rows, KTO_LABELS)
    ]


def kto_batch(rows, tokenizer, kl: bool) -> dict[str, np.ndarray]:
    featurizer = KTOFeaturizer(name="kto", tokenizer=tokenizer, max_length=T)
    featurizer.detect(rows[0])
    return KTOCollator(T, tokenizer.pad_token_id, group=len(rows), kl=kl)(
        featurizer(rows, range(len(rows)))
    )


def torch_kto_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    as_long = lambda x: torch.as_tensor(x, dtype=torch.long)  # noqa: E731
    out = {
        "input_ids": as_long(batch["input_ids"]),
        "attention_mask": as_long(batch["attention_mask"]),
        "completion_mask": as_long(batch["labels"] != -100),
        "label": torch.as_tensor(batch["label"] > 0.5),
    }
    if "KL_input_ids" in batch:
        out["KL_input_ids"] = as_long(batch["KL_input_ids"])
        out["KL_attention_mask"] = as_long(batch["KL_attention_mask"])
        out["KL_completion_mask"] = as_long(batch["KL_labels"] != -100)
    return out


KTO_CASES = {
    "kto": dict(loss_type="kto", desirable_weight=1.0, undesirable_weight=1.6),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired", desirable_weight=0.8),
}
KTO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",  # chosen - rejected, once missing
    "logps/chosen",
    "logps/rejected",
    "entropy",
)


@pytest.mark.parametrize("case", list(KTO_CASES))
def test_kto_equals_trl_with_unbalanced_labels(checkpoints, kto_rows, tokenizer, tmp_path, case):
    kwargs = {"beta": 0.3, **KTO_CASES[case]}
    batch = kto_batch(kto_rows, tokenizer, kl=kwargs["loss_type"] == "kto")
    config = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"),
        max_length=T,
        per_device_train_batch_size=8,
        use_cpu=True,
        bf16=False,
        report_to=[],
        gradient_checkpointing=False,
        **kwargs,
    )
    trainer = trl.KTOTrainer(
        model=hf_model(checkpoints[0]),
        ref_model=hf_model(checkpoints[1]),
        args=config,
        train_dataset=datasets.Dataset.from_list(kto_rows),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, torch_kto_batch(batch), return_outputs=False)
    loss.backward()
    norm, embedding = torch_grad_norms(trainer.model)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}

    objective = kto_objective(
        RunSettings.from_arguments(KTOArguments(max_sequence_length=T, **kwargs))
    )
    policy = AutoModelForCausalLM.from_pretrained(checkpoints[0])
    reference = AutoModelForCausalLM.from_pretrained(checkpoints[1])
    logs, our_norm, our_embedding = jax_loss_and_grads(
        objective, TaskModel(policy, reference=reference), batch
    )
    assert_same(logs, {"loss": loss.item()}, ("loss",), "loss")
    assert_same(logs, metrics, (*KTO_METRICS, "kl"), case)
    if case == "kto":
        assert metrics["kl"] > 0  # the estimate is active, not clamped to 0
    assert_grads(our_norm, norm, our_embedding, embedding)


def test_kl_completions_rotate_within_a_batch_as_trl_s(checkpoints, kto_rows, tokenizer, tmp_path):
    """TRL pairs each prompt with the previous example's completion within each batch of
    per_device_train_batch_size rows; so does the collator within each micro-batch's rows."""
    config = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"),
        max_length=T,
        per_device_train_batch_size=3,
        use_cpu=True,
        bf16=False,
        report_to=[],
    )
    trainer = trl.KTOTrainer(
        model=hf_model(checkpoints[0]),
        ref_model=hf_model(checkpoints[1]),
        args=config,
        train_dataset=datasets.Dataset.from_list(kto_rows),
        processing_class=tokenizer,
    )
    data = trainer.train_dataset
    source = rotated(len(data), 3)
    assert source.tolist() == [2, 0, 1, 5, 3, 4, 7, 6]
    for i, j in enumerate(source):
        assert data[i]["KL_completion_ids"] == data[int(j)]["completion_ids"]


def test_preference_pairs_unpair_into_kto_rows():
    pairs = uneven_pairs(3)
    rows = unpair_preferences(pairs)
    assert [r["label"] for r in rows] == [True, False] * 3
    assert rows[2] == {
        "prompt": pairs[1]["prompt"],
        "completion": pairs[1]["chosen"],
        "label": True,
    }
    mapped = unpair_preferences(datasets.Dataset.from_list(pairs))
    assert mapped.column_names == ["prompt", "completion", "label"] and mapped.to_list() == rows

"""DPO of a vision-language model (Gemma 3) on image preference pairs in TRL's vision format
(issue 50): each pair's chosen and rejected sequences are the token ids TRL 1.16's vision
preference collator makes; the loss, its gradient and the logged rewards and log-probs equal
TRL's DPOTrainer on the same pairs (a reference other than the policy, so the rewards are not
zero); `jaxtrain train --task dpo` runs on image pairs from files."""

from __future__ import annotations

import copy
import json
import os

import datasets
import jax
import numpy as np
import pytest
import torch
import transformers
import yaml
from flax import nnx
from vlm_fixtures import picture, write_checkpoint

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DataCollatorForVisionPreference  # noqa: E402

from jaxtrain.cli import main  # noqa: E402
from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.errors import ArgumentError  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer  # noqa: E402
from jaxtrain.objective import summarize_sums  # noqa: E402
from jaxtrain.trainers import DPOArguments, DPOTrainer  # noqa: E402
from jaxtrain.trainers.dpo import dpo_objective  # noqa: E402

RTOL = 1e-5
PAIRS = 4
ANSWERS = [("it shows a red square", "it shows a blue circle"),
           ("a green circle", "two small big square"),
           ("the picture is blue", "it is red and green"),
           ("a small red shape", "the colour of the shape is big")]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_dpo")
    return write_checkpoint(root / "policy", seed=0), write_checkpoint(root / "reference", seed=1)


def pairs(n: int = PAIRS, images=None) -> list[dict]:
    rows = []
    for i in range(n):
        chosen, rejected = ANSWERS[i % len(ANSWERS)]
        rows.append({
            "images": [picture(i, 24 + 6 * i, 30)] if images is None else images[i],
            "prompt": [{"role": "user", "content": "describe this image"}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        })  # fmt: skip
    return rows


def test_image_pairs_loss_gradient_and_rewards_equal_trl(checkpoints, tmp_path):
    policy_dir, reference_dir = checkpoints
    processor = load_tokenizer(policy_dir)
    rows = pairs()
    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PAIRS, use_cpu=True,
        bf16=False, report_to=[], max_length=None, beta=0.1, loss_type=["sigmoid"],
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=transformers.AutoModelForImageTextToText.from_pretrained(policy_dir),
        ref_model=transformers.AutoModelForImageTextToText.from_pretrained(reference_dir),
        args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=processor,
    )  # fmt: skip
    batch = DataCollatorForVisionPreference(processor)(copy.deepcopy(rows))
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = [p.grad.double() for p in trainer.model.parameters() if p.grad is not None]
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads)))
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    args = DPOArguments(output_dir=str(tmp_path / "ours"), max_steps=1, total_batch_size=PAIRS,
                        max_sequence_length=48, beta=0.1)  # fmt: skip
    ours = DPOTrainer(
        arguments=args, model=AutoModelForCausalLM.from_pretrained(str(policy_dir)),
        reference_model=AutoModelForCausalLM.from_pretrained(str(reference_dir)),
        processing_class=processor,
    )  # fmt: skip
    examples = ours.create_featurizer("dataset_train")(rows, range(PAIRS))
    # The sequences are TRL's: rows [chosen...; rejected...] of its batch, flushed left.
    for i, example in enumerate(examples):
        for side, row in (("chosen", i), ("rejected", PAIRS + i)):
            real = batch["attention_mask"][row].numpy().astype(bool)
            np.testing.assert_array_equal(
                example[f"{side}_input_ids"], batch["input_ids"][row][real]
            )
            completion = batch["completion_mask"][row].numpy()[real].astype(bool)
            np.testing.assert_array_equal(example[f"{side}_labels"] >= 0, completion)
    ours_batch = {k: jax.numpy.asarray(v) for k, v in ours.data_collator(examples).items()}
    objective = dpo_objective(RunSettings.from_arguments(args))
    graphdef, params, rest = nnx.split(ours.model, nnx.Param, ...)

    def objective_loss(params):
        sums = objective.loss_sums(nnx.merge(graphdef, params, rest), ours_batch, jax.random.key(0))
        return sums["loss_sum"] / sums["tokens"], sums

    our_grads, sums = jax.jit(jax.grad(objective_loss, has_aux=True))(params)
    logs = summarize_sums({k: float(v) for k, v in sums.items()}, perplexity=False,
                          differences=objective.differences)  # fmt: skip
    our_norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2)
                                 for g in jax.tree.leaves(our_grads))))  # fmt: skip
    if os.environ.get("JAXTRAIN_SHOW_PARITY"):
        print({k: (logs.get(k), theirs.get(k)) for k in theirs}, our_norm, norm, loss.item())
    np.testing.assert_allclose(logs["loss"], loss.item(), rtol=RTOL)
    np.testing.assert_allclose(our_norm, norm, rtol=RTOL)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected", "rewards/accuracies"):  # fmt: skip
        np.testing.assert_allclose(logs[key], theirs[key], rtol=RTOL, atol=1e-6, err_msg=key)
    assert abs(theirs["rewards/margins"]) > 1e-3  # the two models differ: not a zero test


def test_dpo_on_image_pairs_from_the_command_line(checkpoints, tmp_path, capsys):
    policy_dir, _ = checkpoints
    images = []
    for i in range(8):
        picture(i).save(tmp_path / f"{i}.png")
        images.append([str(tmp_path / f"{i}.png")])
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs(8, images)))
    run = tmp_path / "run"
    config = dict(
        task="dpo", output_dir=str(run), max_steps=2, total_batch_size=4, max_sequence_length=48,
        logging_steps=1, evaluation_strategy="no", progress_bar="none", report_to="jsonl",
        run_report=False, model={"pretrained": str(policy_dir)},
        data={"source": "files", "train_files": str(data)}, sample={"max_new_tokens": 2},
    )  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    logs = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in logs if "rewards/margins" in r] == [1, 2]
    # The end-of-run sample and `jaxtrain sample` ask the first pair's prompt, with its image.
    out = capsys.readouterr().out
    assert "failed" not in out and "--- sample" in out
    assert main(["sample", str(run), "--max_new_tokens", "2"]) == 0
    sampled = capsys.readouterr().out.split("--- sample")[-1]
    assert "<start_of_image>" in sampled and "describe this image" in sampled


def test_image_pairs_refuse_packing_with_or_without_a_collator_of_the_users(checkpoints, tmp_path):
    """Image pairs are not packed (their images would need slots of their own in the rows):
    refused in one line naming that reason, also when the user brings a collator (that path
    once said only that packing and a collator do not combine, as if dropping the collator
    would do)."""
    policy_dir, _ = checkpoints
    processor = load_tokenizer(policy_dir)
    args = DPOArguments(output_dir=str(tmp_path), max_steps=1, total_batch_size=PAIRS,
                        max_sequence_length=128, packing=True, precompute_reference_logps=False,
                        reference_free=True)  # fmt: skip
    for collator in (None, lambda examples: examples):
        with pytest.raises(ArgumentError, match="preference pairs with images are not packed yet"):
            DPOTrainer(arguments=args, model=AutoModelForCausalLM.from_pretrained(str(policy_dir)),
                       dataset_train=pairs(), processing_class=processor,
                       data_collator=collator)  # fmt: skip

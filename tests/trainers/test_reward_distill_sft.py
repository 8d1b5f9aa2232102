"""RewardTrainer (accuracy, export loaded by transformers), DistillationTrainer (KL zero for a
copy of the teacher, the student moves toward the teacher) and SFTTrainer (prompt/completion)."""

from __future__ import annotations

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from trainer_fixtures import StepMetrics, tiny_arguments, tiny_model

from jaxtrain import TrainingArguments
from jaxtrain.trainers import (
    DistillationArguments,
    DistillationTrainer,
    RewardTrainer,
    SFTArguments,
    SFTTrainer,
)
from jaxtrain.training.step import causal_lm_sums


def separable_pairs(n: int = 16) -> datasets.Dataset:
    """Chosen answers are even numbers, rejected ones odd: separable from the last token."""
    rows = [
        {
            "prompt": f"what is {i % 7} + {i % 5} ?",
            "chosen": f"{2 * (i % 10)}",
            "rejected": f"{2 * ((i + 3) % 10) + 1}",
        }
        for i in range(n)
    ]
    return datasets.Dataset.from_list(rows)


def test_reward_model_learns_and_transformers_loads_the_export(tokenizer, tmp_path):
    rows = separable_pairs()
    args = tiny_arguments(TrainingArguments, tmp_path, max_steps=16, logging_steps=8)
    trainer = RewardTrainer(
        arguments=args,
        model=tiny_model(),
        dataset_train=rows,
        dataset_eval=rows,
        processing_class=tokenizer,
    )
    out = trainer.train()
    assert out.metrics["eval/accuracy"] > 0.9
    # Only the backbone (without its unused LM head) and the score head are trained.
    assert "lm_head" not in str(jax.tree_util.tree_structure(out.state.params))

    export = trainer.save_pretrained(out.state, tmp_path / "export")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        export, attn_implementation="eager"
    ).eval()
    batch = next(trainer.eval_loader.batches())
    reward = trainer.model_from_state(out.state)
    for prefix in ("", "rejected_"):
        ids, mask = batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"]
        ours = np.asarray(nnx.jit(lambda m, i, a: m(i, a))(reward, ids, mask))
        with torch.no_grad():
            theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits[:, 0].numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def text_rows(n: int = 16) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"text": f"what is {i % 7} + {i % 5} ? {i % 7 + i % 5}"} for i in range(n)]
    )


def test_distillation_kl_is_zero_for_a_copy_of_the_teacher(tokenizer, tmp_path):
    teacher = tiny_model(seed=1)
    trainer = DistillationTrainer(
        arguments=tiny_arguments(DistillationArguments, tmp_path),
        model=nnx.clone(teacher),
        teacher_model=teacher,
        dataset_train=text_rows(),
        processing_class=tokenizer,
    )
    batch = jax.tree.map(lambda x: jnp.asarray(x[0]), next(trainer.train_source.loader.batches()))
    sums = trainer.program.objective.loss_sums(trainer.model, batch, None)
    assert float(sums["distill/kl_sum"]) == pytest.approx(0.0, abs=1e-5)
    assert float(sums["distill/ce_sum"]) > 0


def test_the_student_moves_toward_the_teacher(tokenizer, tmp_path):
    # A teacher with peaked distributions (large initial weights); the student starts close
    # to uniform, so the two eval losses differ by much.
    teacher, student = tiny_model(seed=1, initializer_range=0.5), tiny_model(seed=2)
    rows = text_rows()
    args = tiny_arguments(
        DistillationArguments,
        tmp_path,
        max_steps=12,
        distill_alpha=1.0,
        distill_temperature=1.0,
        learning_rate=3e-2,
    )
    trainer = DistillationTrainer(
        arguments=args,
        model=student,
        teacher_model=teacher,
        dataset_train=rows,
        processing_class=tokenizer,
        callbacks=[seen := StepMetrics()],
    )
    batch = jax.tree.map(lambda x: jnp.asarray(x[0]), next(trainer.train_source.loader.batches()))

    @nnx.jit
    def ce(model, batch):
        sums = causal_lm_sums(model(batch["input_ids"]), batch["labels"])
        return sums["loss_sum"] / sums["tokens"]

    teacher_loss, before = float(ce(teacher, batch)), float(ce(student, batch))
    assert abs(before - teacher_loss) > 1.0
    out = trainer.train()
    after = float(ce(trainer.model_from_state(out.state), batch))
    assert abs(after - teacher_loss) < abs(before - teacher_loss) - 0.5
    assert seen.steps[-1]["distill/kl_sum"] < 0.8 * seen.steps[0]["distill/kl_sum"]


def test_sft_prompt_completion_rows_learn_the_completion_only(tokenizer, tmp_path):
    rows = [{"prompt": f"what is {i % 7} + 1 ?", "completion": f"{i % 7 + 1}"} for i in range(16)]
    assert SFTArguments(max_steps=3).packing and not SFTArguments().packing
    args = tiny_arguments(SFTArguments, tmp_path, max_steps=2)
    assert args.completion_only_loss and args.packing
    trainer = SFTTrainer(
        arguments=args, model=tiny_model(), dataset_train=rows, processing_class=tokenizer
    )
    example = trainer.create_featurizer("dataset_train")
    example.detect(rows[0])
    (row,) = example(rows[:1], [0])
    learned = tokenizer.convert_ids_to_tokens(row["input_ids"][row["labels"] != -100].tolist())
    assert learned == ["1", "</s>"]
    out = trainer.train()
    assert np.isfinite(out.metrics["loss"])

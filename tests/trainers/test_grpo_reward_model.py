"""A reward model trained and exported by RewardTrainer serves as a GRPO reward function:
its scores equal the RewardModel's own on the rows it was trained on (text and chat), from the
in-memory model and from the exported directory, and a GRPO run uses it."""

from __future__ import annotations

import numpy as np
from flax import nnx
from test_grpo import Logs
from trainer_fixtures import tiny_arguments, tiny_model

from jaxtrain import TrainingArguments
from jaxtrain.trainers import GRPOArguments, GRPOTrainer, RewardTrainer
from jaxtrain.trainers.rewards import reward_model


def pairs(n: int = 8, chat: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        prompt = f"what is {i % 7} + {i % 5} ?"
        row = {"prompt": prompt, "chosen": f"{2 * (i % 10)}", "rejected": f"{(i + 3) % 10} +"}
        if chat:
            row = {
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": row["chosen"]}],
                "rejected": [{"role": "assistant", "content": row["rejected"]}],
            }
        rows.append(row)
    return rows


def own_scores(trainer, state):
    """The RewardModel's scores of the chosen and rejected rows of the first eval batch, as
    its trainer encodes them."""
    batch = next(trainer.eval_loader.batches())
    model = trainer.model_from_state(state)
    score = nnx.jit(lambda m, i, a: m(i, a))
    return [np.asarray(score(model, batch[f"{p}input_ids"], batch[f"{p}attention_mask"]))
            for p in ("", "rejected_")]  # fmt: skip


def test_reward_model_scores_equal_the_reward_model_s_own(tokenizer, tmp_path):
    for chat in (False, True):
        rows = pairs(chat=chat)
        args = tiny_arguments(TrainingArguments, tmp_path / str(chat), max_steps=4,
                              total_batch_size=8, eval_batch_size=8)  # fmt: skip
        trainer = RewardTrainer(arguments=args, model=tiny_model(), dataset_train=rows,
                                dataset_eval=rows, processing_class=tokenizer)  # fmt: skip
        out = trainer.train()
        chosen, rejected = own_scores(trainer, out.state)
        export = trainer.save_pretrained(out.state, tmp_path / f"export{chat}")
        prompts = [r["prompt"] for r in rows]
        text = {side: [r[side][0]["content"] if chat else r[side] for r in rows]
                for side in ("chosen", "rejected")}  # fmt: skip
        for fn in (
            reward_model(trainer.model_from_state(out.state), tokenizer),
            reward_model(export),
        ):  # the exported directory, with its own tokenizer
            np.testing.assert_allclose(fn(prompts, text["chosen"]), chosen, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(fn(prompts, text["rejected"]), rejected, rtol=1e-5,
                                       atol=1e-6)  # fmt: skip
        assert np.ptp(chosen) > 0  # scores that differ by row: not a constant match
    assert reward_model(export).__name__ == f"reward_model(export{chat})"


def test_a_grpo_run_scores_with_the_exported_reward_model(tokenizer, tmp_path):
    rows = pairs()
    trainer = RewardTrainer(
        arguments=tiny_arguments(TrainingArguments, tmp_path / "rm", max_steps=2),
        model=tiny_model(),
        dataset_train=rows,
        processing_class=tokenizer,
    )
    export = trainer.save_pretrained(trainer.train().state, tmp_path / "rm_export")
    fn = reward_model(export, tokenizer)
    logs = Logs()
    grpo = GRPOTrainer(
        arguments=tiny_arguments(
            GRPOArguments,
            tmp_path / "grpo",
            max_steps=2,
            total_batch_size=8,
            num_generations=4,
            max_prompt_length=8,
            max_completion_length=3,
        ),  # fmt: skip
        model=tiny_model(seed=1),
        reward_funcs=[fn],
        dataset_train=[{"prompt": r["prompt"]} for r in rows],
        processing_class=tokenizer,
        callbacks=[logs],
    )
    grpo.train()
    values = [entry["rewards/reward_model(rm_export)"] for entry in logs.logs]
    assert len(values) == 2 and np.isfinite(values).all()

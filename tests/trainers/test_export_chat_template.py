"""An export carries the chat template the run trained with: transformers' own loader
renders a conversation exactly as the SFT run did (TrainingArguments.chat_template wins
over the tokenizer's own template, which the run did not use)."""

from __future__ import annotations

import numpy as np
from trainer_fixtures import CHAT_TEMPLATE, tiny_arguments, tiny_model
from transformers import AutoTokenizer

from jaxtrain.trainers import SFTArguments, SFTTrainer

RUN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
CHAT = [
    {"role": "user", "content": "what is 1 + 2 ?"},
    {"role": "assistant", "content": "3"},
]


def test_the_export_renders_conversations_with_the_runs_chat_template(tokenizer, tmp_path):
    args = tiny_arguments(SFTArguments, tmp_path, max_steps=1, chat_template=RUN_TEMPLATE)
    rows = [{"messages": CHAT}] * 16
    trainer = SFTTrainer(
        arguments=args, model=tiny_model(), dataset_train=rows, processing_class=tokenizer
    )
    featurize = trainer.create_featurizer("dataset_train")
    featurize.detect(rows[0])
    (trained_row,) = featurize(rows[:1], [0])
    out = trainer.save_pretrained(trainer.train().state, tmp_path / "export")

    exported = AutoTokenizer.from_pretrained(out)
    text = exported.apply_chat_template(CHAT, tokenize=False)
    assert text == tokenizer.apply_chat_template(CHAT, chat_template=RUN_TEMPLATE, tokenize=False)
    assert text.startswith("user : what")  # the run's template, not the tokenizer's "<s> user"
    # The very ids the run trained on.
    ids = exported(text, add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(ids, trained_row["input_ids"])
    prompt = exported.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("</s> assistant : ")
    assert tokenizer.chat_template == CHAT_TEMPLATE  # the caller's tokenizer is unchanged


def test_without_a_run_template_the_tokenizers_own_is_exported(tokenizer, tmp_path):
    args = tiny_arguments(SFTArguments, tmp_path, max_steps=1)
    trainer = SFTTrainer(
        arguments=args, model=tiny_model(), dataset_train=[{"messages": CHAT}] * 16,
        processing_class=tokenizer,
    )  # fmt: skip
    out = trainer.save_pretrained(trainer.train().state, tmp_path / "export")
    exported = AutoTokenizer.from_pretrained(out)
    assert exported.apply_chat_template(CHAT, tokenize=False) == tokenizer.apply_chat_template(
        CHAT, tokenize=False
    )

"""Columns, chat rendering, truncation, label masking and bad-input errors."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.data import DatasetError, build_eval_loader, build_train_loader, render_chat


def args(**kw) -> TrainingArguments:
    base = dict(total_batch_size=2, max_sequence_length=6, shuffle_train=False, progress_bar="none")
    return TrainingArguments(**(base | kw))


def batch(rows, tokenizer=None, collator=None, **kw):
    loader = build_train_loader(args(**kw), rows, tokenizer=tokenizer, collator=collator)
    return next(loader.batches(with_stats=True))


@pytest.mark.parametrize("packing", [False, True])
def test_truncation_modes_keep_the_right_end(packing):
    rows = [{"input_ids": list(range(1, 10))}, {"input_ids": [20, 21]}]
    # Packing splits long documents by default; truncation is what this test is about.
    extra = {"packing": True, "max_steps": 3, "split_long_documents": False} if packing else {}
    start, s1 = batch(rows, truncation_mode="keep_start", **extra)
    end, s2 = batch(rows, truncation_mode="keep_end", **extra)
    assert start["input_ids"][0, 0].tolist() == [1, 2, 3, 4, 5, 6]
    assert end["input_ids"][0, 0].tolist() == [4, 5, 6, 7, 8, 9]
    assert s1.num_truncated_tokens == s2.num_truncated_tokens == 3


def test_labels_are_ignored_on_padding_and_counted():
    b, stats = batch([{"input_ids": [5, 6]}, {"input_ids": [7, 8, 9]}])
    assert b["labels"][0].tolist() == [[5, 6] + [-100] * 4, [7, 8, 9] + [-100] * 3]
    assert stats.num_padding_tokens == 7 and stats.num_truncated_tokens == 0


def test_chat_completion_only_loss_masks_the_prompt(chat_tokenizer):
    messages = [
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "c d"},
        {"role": "user", "content": "e"},
        {"role": "assistant", "content": "f"},
    ]
    out = render_chat(chat_tokenizer, messages, completion_only_loss=True)
    words = chat_tokenizer.convert_ids_to_tokens(out["input_ids"].tolist())
    learned = [w for w, lab in zip(words, out["labels"]) if lab != -100]
    assert learned == ["c", "d", "</s>", "f", "</s>"]
    full = render_chat(chat_tokenizer, messages)
    assert (full["labels"] == full["input_ids"]).all()

    rows = [{"messages": messages, "id": 1}] * 2
    b, _ = batch(
        rows,
        chat_tokenizer,
        completion_only_loss=True,
        max_sequence_length=40,
        ids_to_pop_from_dataset=["id"],
    )
    n = len(out["input_ids"])
    assert b["labels"][0, 0, :n].tolist() == out["labels"].tolist()
    assert (b["labels"][0, 0, n:] == -100).all()


# Transformers marks the tokens of `{% generation %}` blocks: the reply and its end of turn.
MARKED_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}\n{% endgeneration %}{% else %}{{ m['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.mark.parametrize("reply", ["2", "The answer is 13"])
def test_completion_only_labels_are_transformers_assistant_masks(reply):
    """The prompt ends in a space that the byte-level BPE joins to the reply's first token
    (" 2"): that token was left out (a one-token reply learned nothing)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    text = ["user: what is 1+1\nassistant: 2\n", "The answer is 13 and 2 or 1"] * 20
    bpe.train_from_iterator(text, vocab_size=300, min_frequency=1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tokenizer.chat_template = MARKED_TEMPLATE
    messages = [{"role": "user", "content": "what is 1+1"}, {"role": "assistant", "content": reply},
                {"role": "user", "content": "and 2"}, {"role": "assistant", "content": reply}]  # fmt: skip
    ours = render_chat(tokenizer, messages, completion_only_loss=True)
    theirs = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ours["input_ids"].tolist() == list(theirs["input_ids"])
    assert (ours["labels"] != -100).astype(int).tolist() == list(theirs["assistant_masks"])
    learned = tokenizer.decode(ours["input_ids"][ours["labels"] != -100])
    assert learned.split() == reply.split() * 2  # the whole replies, no word lost


def test_chat_template_argument_overrides_the_tokenizer(chat_tokenizer):
    rows = [{"messages": [{"role": "user", "content": "a"}]}] * 2
    b, _ = batch(
        rows, chat_tokenizer, chat_template="{{ messages[0]['content'] }} b", max_sequence_length=4
    )
    assert chat_tokenizer.convert_ids_to_tokens(b["input_ids"][0, 0, :2].tolist()) == ["a", "b"]


def test_user_data_collator_and_popped_columns():
    seen = []

    def collator(examples):
        seen.append(sorted(examples[0]))
        ids = np.array([[len(e["input_ids"])] * 3 for e in examples], np.int32)
        return {"input_ids": ids, "labels": ids}

    rows = [{"input_ids": [1, 2], "meta": "x"}, {"input_ids": [3], "meta": "y"}]
    b, stats = batch(rows, collator=collator, ids_to_pop_from_dataset=["meta"])
    assert seen == [["input_ids"]] and stats is None
    assert b["input_ids"][0].tolist() == [[2, 2, 2], [1, 1, 1]]


@pytest.mark.parametrize(
    ("rows", "kw", "pattern"),
    [
        ([{"body": "x"}] * 2, {}, r"neither an 'input_ids'.*\['body'\].*text_column="),
        ([{"input_ids": "1 2"}] * 2, {}, "'input_ids' must hold sequences of ints.*str"),
        ([], {}, "dataset_train is empty"),
        ([{"input_ids": [1, 2]}], {}, "has 1 rows but one global batch needs 2"),
        (
            [{"messages": [{"role": "user", "content": "a"}]}] * 2,
            {"tok": None},
            "chat column 'messages'.*processing_class",
        ),
    ],
)
def test_bad_datasets_are_refused_before_training(rows, kw, pattern, chat_tokenizer):
    tokenizer = kw.pop("tok", chat_tokenizer)
    with pytest.raises(DatasetError, match=pattern):
        build_train_loader(args(), rows, tokenizer=tokenizer)


def test_bad_rows_name_row_and_column(chat_tokenizer):
    rows = [{"input_ids": [1, 2]}, {"input_ids": [1.5, 2.0]}]
    with pytest.raises(DatasetError, match=r"row 1: column 'input_ids'.*1-D sequence of ints"):
        batch(rows)
    rows = [{"input_ids": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}]
    with pytest.raises(DatasetError, match="row 1: column 'labels' has length 1"):
        batch(rows)
    rows = [{"text": "a"}, {"text": 3}]
    with pytest.raises(DatasetError, match="row 1: column 'text' is int, expected str"):
        batch(rows, chat_tokenizer)
    bad_chat = [{"messages": [{"role": "user", "content": "a"}]}, {"messages": "hi"}]
    with pytest.raises(DatasetError, match="row 1, column 'messages'.*list of"):
        batch(bad_chat, chat_tokenizer)


def test_a_misspelled_role_in_a_file_names_its_row(chat_tokenizer, tmp_path):
    """A file's rows share one schema: row 1's "rol" became a key of every message, and
    row 1's role null, which rendered as ': a' and trained."""
    from jaxtrain.data.files import load_files

    lines = ['{"messages": [{"role": "user", "content": "a"}]}',
             '{"messages": [{"rol": "user", "content": "a"}]}']  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_files(str(tmp_path / "chat.jsonl"), name="data.train_files")
    assert rows[1]["messages"][0]["role"] is None  # what Arrow made of it
    with pytest.raises(DatasetError, match=r"row 1, column 'messages'.*message 0 has no 'role'"):
        batch(rows, chat_tokenizer, max_sequence_length=8)

    def failing_tokenizer(texts):
        if "boom" in texts:
            raise RuntimeError("cannot encode boom")
        return {"input_ids": [[1] for _ in texts]}

    rows = datasets.Dataset.from_list([{"text": "ok"}, {"text": "boom"}])
    with pytest.raises(DatasetError, match="row 1: the tokenizer failed.*cannot encode boom"):
        batch(rows, failing_tokenizer)


def test_eval_loader_covers_every_row_once_with_masked_fillers():
    rows = [{"input_ids": [i + 1] * 2} for i in range(5)]
    loader = build_eval_loader(args(eval_batch_size=4), iter(rows))
    batches = list(loader.batches())
    assert loader.num_batches == 2 and all(b["input_ids"].shape == (4, 6) for b in batches)
    firsts = [int(x) for b in batches for x in b["input_ids"][:, 0]]
    assert firsts == [1, 2, 3, 4, 5, 0, 0, 0]
    assert (batches[1]["labels"][1:] == -100).all()


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"packing": True}, "packing=True.*max_steps"),
        ({"streaming": True}, "streaming=True.*max_steps"),
        ({"stream_window": 0}, "stream_window must be > 0"),
        ({"ids_to_pop_from_dataset": ["input_ids"]}, "must not drop 'input_ids'"),
        ({"messages_column": ""}, "messages_column must be"),
        ({"drop_last": "yes"}, "drop_last must be true or false"),
    ],
)
def test_data_arguments_are_validated(kw, pattern):
    with pytest.raises(ArgumentError, match=pattern):
        TrainingArguments(**kw)
    assert TrainingArguments(ids_to_pop_from_dataset="a, b").ids_to_pop_from_dataset == ["a", "b"]

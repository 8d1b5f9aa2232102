"""The whole of a map-style dataset is checked before anything is compiled (vectorised over
its Arrow column); streams are checked row by row as read. Ids outside the vocabulary,
datasets without a target token, and truncation that drops tokens."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.data import DatasetError, build_eval_loader, build_train_loader
from jaxtrain.data.loader import prepare_source
from jaxtrain.data.sources import as_source
from jaxtrain.trainers.data import PairFeaturizer
from jaxtrain.trainers.kto_data import KTOFeaturizer

VOCAB = 50


def args(**kw) -> TrainingArguments:
    base = dict(total_batch_size=2, max_sequence_length=8, shuffle_train=False, max_steps=3)
    return TrainingArguments(**(base | kw))


def rows_with(bad_row: int, bad_ids: list[int], n: int = 400) -> list[list[int]]:
    rows = [[1 + (i % 40), 2, 3, 4] for i in range(n)]
    rows[bad_row] = bad_ids
    return rows


@pytest.mark.parametrize("bad_ids", [[5, -3, 7], [5, VOCAB + 12, 7]])
def test_an_id_outside_the_vocabulary_in_a_late_row_fails_at_construction(bad_ids):
    dataset = datasets.Dataset.from_dict({"input_ids": rows_with(371, bad_ids)})
    with pytest.raises(DatasetError) as err:
        build_train_loader(args(), dataset, vocab_size=VOCAB)
    message = str(err.value)
    assert "row 371" in message and "'input_ids'" in message
    assert f"vocab_size={VOCAB}" in message and str(max(bad_ids)) in message


@pytest.mark.parametrize("label", [-1, -5, VOCAB])
def test_a_label_neither_ignored_nor_in_the_vocabulary_is_refused(label):
    """-1 trained as the vocabulary's last id, silently; VOCAB ended as a NaN loss blamed on
    the learning rate. Every way rows arrive is checked: Arrow-held and listed rows up front,
    streamed rows as read."""
    ids = rows_with(0, [5, 6, 7], n=40)
    labels = [list(r) for r in ids]
    labels[23][1] = label
    columns = {"input_ids": ids, "labels": labels}
    pattern = (
        rf"row .*23.*: column 'labels' holds {label}, but a label is -100 .*vocab_size={VOCAB}"
    )
    with pytest.raises(DatasetError, match=pattern):
        build_train_loader(args(), datasets.Dataset.from_dict(columns), vocab_size=VOCAB)
    rows = [{"input_ids": i, "labels": t} for i, t in zip(ids, labels)]
    with pytest.raises(DatasetError, match=pattern):
        build_train_loader(args(), rows, vocab_size=VOCAB)
    stream = datasets.Dataset.from_dict(columns).to_iterable_dataset()
    with pytest.raises(DatasetError, match=pattern):
        for _ in zip(range(20), build_train_loader(args(), stream, vocab_size=VOCAB).batches()):
            pass
    labels[23][1] = -100  # ignored: taken
    build_train_loader(args(), datasets.Dataset.from_dict(columns), vocab_size=VOCAB)


def test_the_eval_set_is_checked_too():
    dataset = datasets.Dataset.from_dict({"input_ids": rows_with(7, [VOCAB])})
    with pytest.raises(DatasetError, match=r"dataset_eval row 7"):
        build_eval_loader(args(), dataset, vocab_size=VOCAB)


def test_a_stream_is_checked_row_by_row_naming_the_row():
    rows = rows_with(5, [3, VOCAB + 1], n=12)
    stream = datasets.Dataset.from_dict({"input_ids": rows}).to_iterable_dataset()
    loader = build_train_loader(args(), stream, vocab_size=VOCAB)
    with pytest.raises(DatasetError, match=rf"row .*5.*vocab_size={VOCAB}"):
        for _ in zip(range(6), loader.batches()):
            pass


@pytest.mark.parametrize(
    "columns",
    [
        {"input_ids": [[] for _ in range(6)]},
        {"input_ids": [[4] for _ in range(6)]},
        {"input_ids": [[4, 5, 6]] * 6, "labels": [[-100, -100, -100]] * 6},
    ],
)
def test_a_dataset_without_target_tokens_is_refused(columns):
    with pytest.raises(DatasetError, match="no target tokens"):
        build_train_loader(args(), datasets.Dataset.from_dict(columns), vocab_size=VOCAB)


def test_truncation_that_drops_tokens_is_one_warning_with_its_share(caplog):
    long_rows = datasets.Dataset.from_dict({"input_ids": [[3] * 20] * 4})
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        build_train_loader(args(), long_rows, vocab_size=VOCAB)
    warnings = [r.getMessage() for r in caplog.records if "max_sequence_length" in r.getMessage()]
    assert len(warnings) == 1
    assert "60.0% of its tokens (48 of 80, in 4 of 4 rows)" in warnings[0]
    assert "use packing=True to split" in warnings[0]
    caplog.clear()  # packing on already: the setting that splits is split_long_documents
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        build_train_loader(
            args(packing=True, split_long_documents=False), long_rows, vocab_size=VOCAB
        )
    warnings = [r.getMessage() for r in caplog.records if "max_sequence_length" in r.getMessage()]
    assert len(warnings) == 1 and "use split_long_documents=True to split" in warnings[0]


def test_text_rows_from_files_warn_about_truncation_at_the_start(tmp_path, caplog, chat_tokenizer):
    """Text rows are tokenized as they are read, so the share was only known at the end of the
    run; a sample tokenized when the loader is built gives the warning at the start."""
    import json

    from jaxtrain.data import load_files

    lines = [{"text": " ".join(["a"] * (12 if i % 4 == 0 else 4))} for i in range(300)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = load_files(str(path), name="data.train_files")
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        build_train_loader(args(), rows, tokenizer=chat_tokenizer, vocab_size=VOCAB)
    warnings = [r.getMessage() for r in caplog.records if "max_sequence_length" in r.getMessage()]
    assert len(warnings) == 1, warnings
    # Every 4th row is long; the sample is 256 rows spread evenly over the 300.
    sampled = np.unique(np.linspace(0, 299, 256).astype(int))
    long_rows = int(np.count_nonzero(sampled % 4 == 0))
    assert f"in {long_rows} of 256 rows sampled from its 300)" in warnings[0], warnings[0]


def test_text_rows_without_a_token_to_learn_are_refused_or_warned(caplog, chat_tokenizer):
    """Rows of empty text trained (loss 0) and the run said "done (completed)"."""
    empty = datasets.Dataset.from_dict({"text": [""] * 8})
    with pytest.raises(DatasetError, match="dataset_train has no target tokens in any of its 8"):
        build_train_loader(args(), empty, tokenizer=chat_tokenizer, vocab_size=VOCAB)
    # A sample of a larger dataset cannot speak for every row: a warning.
    sampled = set(np.unique(np.linspace(0, 299, 256).astype(int)).tolist())
    unsampled = min(set(range(300)) - sampled)
    mostly = datasets.Dataset.from_dict(
        {"text": ["a b" if i == unsampled else "" for i in range(300)]}
    )
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        build_train_loader(args(), mostly, tokenizer=chat_tokenizer, vocab_size=VOCAB)
    assert "none of the 256 rows sampled from its 300 has a token to learn" in caplog.text


def test_task_rows_are_named_in_the_order_of_a_shuffled_dataset(chat_tokenizer):
    # Arrow decides in storage order; the error names the row as the dataset orders it.
    rows = [{"prompt": "a", "completion": "b", "label": i % 2 == 0} for i in range(1000)]
    for bad in (10, 900):
        rows[bad]["label"] = None
    dataset = datasets.Dataset.from_list(rows).shuffle(seed=0)
    first = [label is None for label in dataset["label"]].index(True)
    featurizer = KTOFeaturizer(name="dataset_train", tokenizer=chat_tokenizer, max_length=8)
    with pytest.raises(DatasetError, match=rf"dataset_train row {first}: column 'label'"):
        prepare_source(as_source(dataset, name="dataset_train"), featurizer)


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda row: row.pop("rejected"), "row 24999 has no column 'rejected'"),
        # Values Arrow cannot hold in one column: every row is looped over instead.
        (lambda row: row.update(chosen=["x"]), "row 24999: column 'chosen' must be a string"),
    ],
)
def test_a_long_list_of_rows_is_checked_to_its_last_row(chat_tokenizer, spoil, message):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"} for _ in range(25_000)]
    spoil(rows[-1])
    featurizer = PairFeaturizer(name="dataset_train", tokenizer=chat_tokenizer, max_length=8)
    with pytest.raises(DatasetError, match=message):
        prepare_source(as_source(rows, name="dataset_train"), featurizer)


def test_task_rows_that_reached_a_library_s_error_or_a_nan_loss_name_the_row(chat_tokenizer):
    """Each failed outside jaxtrain's checks: a null GRPO prompt (transformers: "specify either
    `text` or `text_target`"), a NaN margin (a NaN loss, "lower learning_rate"), chat pairs
    with a tokenizer without a template (transformers' chat-template error)."""
    import copy

    from jaxtrain.trainers.grpo_prompts import read_prompts

    with pytest.raises(DatasetError, match="row 1: column 'prompt' is null"):
        read_prompts([{"prompt": "a"}, {"prompt": None}], chat_tokenizer, limit=8)
    pairs = [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": 0.5} for _ in range(8)]
    pairs[3]["margin"] = float("nan")
    for dataset in (pairs, datasets.Dataset.from_list(pairs)):
        featurizer = PairFeaturizer(name="dataset_train", tokenizer=chat_tokenizer, max_length=8)
        with pytest.raises(DatasetError, match="row 3: column 'margin' must be a finite number"):
            prepare_source(as_source(dataset, name="dataset_train"), featurizer)
    plain = copy.deepcopy(chat_tokenizer)
    plain.chat_template = None
    talk = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chats = [{"chosen": talk, "rejected": talk}] * 4
    for featurizer in (
        PairFeaturizer(name="dataset_train", tokenizer=plain, max_length=8),
        KTOFeaturizer(name="dataset_train", tokenizer=plain, max_length=8),
    ):
        with pytest.raises(
            DatasetError, match="chat messages but the tokenizer has no chat_template"
        ):
            rows = chats if isinstance(featurizer, PairFeaturizer) else [
                {"prompt": talk[:1], "completion": talk[1:], "label": True}
            ] * 4  # fmt: skip
            prepare_source(as_source(rows, name="dataset_train"), featurizer)

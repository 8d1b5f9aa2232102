"""BatchLoader, eval_batches, validate_dataset and prefetch on small synthetic datasets."""

from __future__ import annotations

import threading
import time

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jaxtrain.data import (
    BatchLoader,
    DatasetError,
    eval_batches,
    num_eval_batches,
    prefetch,
    validate_dataset,
)

PAD = 0
T = 6


def id_dataset(n: int) -> datasets.Dataset:
    """Row i holds tokens i+1 repeated (1 + i % 4) times, so every row is recognisable."""
    return datasets.Dataset.from_dict({"input_ids": [[i + 1] * (1 + i % 4) for i in range(n)]})


def rows_of(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Dataset row index of every batch row (-1 for fully masked filler rows)."""
    first = batch["input_ids"][..., 0].astype(np.int64) - 1
    return np.where(batch["attention_mask"][..., 0] == 1, first, -1)


def take(iterator, k):
    return [next(iterator) for _ in range(k)]


def make_loader(ds, **kw) -> BatchLoader:
    args = dict(global_batch_size=8, accumulation_steps=2, seq_len=T, pad_token_id=PAD, seed=3)
    return BatchLoader(ds, **(args | kw))


@pytest.fixture(scope="module")
def word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate("abcdefgh")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def test_shapes_dtypes_and_steps_per_epoch():
    loader = make_loader(id_dataset(50))
    assert loader.steps_per_epoch == 6 and loader.micro_batch_size == 4
    batch = next(loader.batches())
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for value in batch.values():
        assert value.shape == (2, 4, T) and value.dtype == np.int32
    assert loader.epoch_of_step(5) == 0 and loader.epoch_of_step(6) == 1


def test_same_seed_same_batches_different_seed_different():
    ds = id_dataset(50)
    a = [rows_of(b) for b in take(make_loader(ds, seed=1).batches(), 8)]
    b = [rows_of(b) for b in take(make_loader(ds, seed=1).batches(), 8)]
    c = [rows_of(b) for b in take(make_loader(ds, seed=2).batches(), 8)]
    np.testing.assert_array_equal(np.stack(a), np.stack(b))
    assert not np.array_equal(np.stack(a), np.stack(c))


def test_each_epoch_covers_each_row_once_and_reshuffles():
    loader = make_loader(id_dataset(50))  # 6 steps * 8 = 48 rows per epoch, 2 dropped
    stream = take(loader.batches(), 12)
    epochs = [
        np.concatenate([rows_of(b).ravel() for b in stream[e * 6 : e * 6 + 6]]) for e in (0, 1)
    ]
    for rows in epochs:
        assert len(rows) == 48 and len(set(rows.tolist())) == 48
        assert set(rows.tolist()) <= set(range(50))
    assert not np.array_equal(epochs[0], epochs[1])


def test_a_saved_position_of_other_data_is_refused_naming_what_differs_and_the_way_out():
    saved = make_loader(id_dataset(50), seed=1).data_state(7)
    assert make_loader(id_dataset(50), seed=1).check_data_state(saved) == 7
    with pytest.raises(DatasetError) as refused:
        make_loader(id_dataset(60), seed=2).check_data_state(saved)
    message = str(refused.value)
    assert "seed: saved 1, now 2" in message and "num_rows: saved 50, now 60" in message
    assert "max_sequence_length" in message and "overwrite_output_dir=True" in message


def test_no_shuffle_is_dataset_order():
    loader = make_loader(id_dataset(16), shuffle=False)
    np.testing.assert_array_equal(rows_of(next(loader.batches())).ravel(), np.arange(8))


def test_start_step_resumes_the_uninterrupted_stream():
    ds = id_dataset(50)
    full = take(make_loader(ds).batches(), 15)
    for k in (1, 5, 6, 11):  # inside an epoch and across epoch boundaries
        resumed = take(make_loader(ds).batches(start_step=k), 15 - k)
        for x, y in zip(full[k:], resumed):
            for key in x:
                np.testing.assert_array_equal(x[key], y[key])


def test_drop_last_false_fills_with_masked_rows():
    loader = make_loader(id_dataset(50), drop_last=False)
    assert loader.steps_per_epoch == 7
    stream = take(loader.batches(), 7)
    rows = np.concatenate([rows_of(b).ravel() for b in stream])
    real = rows[rows >= 0]
    assert sorted(real.tolist()) == list(range(50)) and (rows == -1).sum() == 6
    last = stream[-1]
    filler = rows_of(last) == -1
    assert (last["labels"][filler] == -100).all() and (last["attention_mask"][filler] == 0).all()


def test_labels_column_and_truncation_stats():
    ds = datasets.Dataset.from_dict(
        {"input_ids": [list(range(1, 11))] * 4, "labels": [[-100] * 5 + list(range(6, 11))] * 4}
    )
    loader = make_loader(
        ds, global_batch_size=4, accumulation_steps=1, truncation_mode="keep_start"
    )
    batch, stats = next(loader.batches(with_stats=True))
    np.testing.assert_array_equal(batch["input_ids"][0, 0], [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(batch["labels"][0, 0], [-100] * 5 + [6])
    assert stats.num_truncated_tokens == 4 * 4 and stats.num_padding_tokens == 0


def test_text_rows_are_tokenized_per_batch(word_tokenizer):
    texts = ["a b c", "d e", "f g h a b c d e", "h"]
    loader = BatchLoader(
        [{"text": t} for t in texts],
        global_batch_size=4,
        accumulation_steps=1,
        seq_len=4,
        pad_token_id=word_tokenizer.pad_token_id,
        shuffle=False,
        tokenizer=word_tokenizer,
    )
    batch = next(loader.batches())
    for i, text in enumerate(texts):
        ids = word_tokenizer(text)["input_ids"][-4:]  # default truncation keeps the end
        np.testing.assert_array_equal(batch["input_ids"][0, i, : len(ids)], ids)
        assert batch["attention_mask"][0, i].sum() == len(ids)


def test_bad_text_rows_name_the_row(word_tokenizer):
    rows = [{"text": "a b"}, {"text": "c"}, {"text": None}, {"text": "d"}]
    # A row without the column reads as null from a file: "NoneType" once named no fix.
    # Every row is checked as the loader is built, not when its batch is read.
    with pytest.raises(DatasetError, match="dataset_train row 2: column 'text' is missing"):
        BatchLoader(
            rows, global_batch_size=2, accumulation_steps=1, seq_len=4, pad_token_id=0,
            shuffle=False, tokenizer=word_tokenizer,
        )  # fmt: skip

    def picky_tokenizer(texts):  # a stand-in tokenizer that rejects one input
        if "boom" in texts:
            raise RuntimeError("cannot encode boom")
        return {"input_ids": [[1] * len(t) for t in texts]}

    loader = BatchLoader(
        [{"text": "ok"}, {"text": "boom"}], global_batch_size=2, accumulation_steps=1,
        seq_len=4, pad_token_id=0, shuffle=False, tokenizer=picky_tokenizer,
    )  # fmt: skip
    with pytest.raises(DatasetError, match="row 1.*cannot encode boom"):
        next(loader.batches())


def test_bad_input_ids_row_is_named():
    rows = [{"input_ids": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}]
    loader = BatchLoader(
        rows, global_batch_size=2, accumulation_steps=1, seq_len=4, pad_token_id=0, shuffle=False
    )
    with pytest.raises(DatasetError, match="dataset_train row 1.*'labels'"):
        next(loader.batches())


def test_user_collator_replaces_default():
    seen = []

    def collator(examples):
        seen.append(len(examples))
        ids = np.array([[ex["input_ids"][0]] * 3 for ex in examples], np.int32)
        return {
            "input_ids": ids,
            "labels": ids,
            "row_len": [len(ex["input_ids"]) for ex in examples],
        }

    loader = make_loader(id_dataset(16), shuffle=False, collator=collator)
    batch, stats = next(loader.batches(with_stats=True))
    assert seen == [8] and stats is None
    assert batch["input_ids"].shape == (2, 4, 3) and batch["row_len"].shape == (2, 4)
    np.testing.assert_array_equal(batch["row_len"].ravel(), [1 + i % 4 for i in range(8)])


def test_process_slices_partition_the_global_batch():
    ds = id_dataset(40)
    full = make_loader(ds).batches()
    hosts = [make_loader(ds, process_index=p, process_count=2).batches() for p in (0, 1)]
    for _ in range(3):
        whole = rows_of(next(full))
        parts = [rows_of(next(h)) for h in hosts]
        assert parts[0].shape == (2, 2)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_eval_batches_cover_every_row_once_with_masked_fill():
    ds = id_dataset(11)
    assert num_eval_batches(ds, batch_size=4) == 3
    batches = list(eval_batches(ds, batch_size=4, seq_len=T, pad_token_id=PAD))
    assert len(batches) == 3 and all(b["input_ids"].shape == (4, T) for b in batches)
    rows = np.concatenate([rows_of(b) for b in batches])
    np.testing.assert_array_equal(rows, list(range(11)) + [-1])
    last = batches[-1]
    assert (last["labels"][3] == -100).all() and (last["attention_mask"][3] == 0).all()
    real_tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert real_tokens == sum(1 + i % 4 for i in range(11))


def test_eval_batches_with_collator_masks_fill_rows():
    def collator(examples):
        ids = np.array([[ex["input_ids"][0]] * 2 for ex in examples], np.int32)
        return {"input_ids": ids, "labels": ids.copy(), "attention_mask": np.ones_like(ids)}

    batches = list(
        eval_batches(id_dataset(5), batch_size=4, seq_len=T, pad_token_id=PAD, collator=collator)
    )
    last = batches[-1]
    assert (last["labels"][1:] == -100).all() and (last["attention_mask"][1:] == 0).all()
    assert (last["labels"][0] == 5).all()


@pytest.mark.parametrize(
    ("dataset", "kwargs", "pattern"),
    [
        ([], {}, "my_ds is empty"),
        (
            datasets.Dataset.from_dict({"body": ["x"]}),
            {},
            r"my_ds.*'input_ids'.*'text'.*\['body'\]",
        ),
        ([{"text": "hello"}], {}, "my_ds.*'text'.*processing_class="),
        ([{"input_ids": "1 2 3"}], {}, "my_ds.*'input_ids'.*ints.*str"),
        ([{"input_ids": [1.5, 2.0]}], {}, "my_ds.*'input_ids'.*ints"),
        (id_dataset(3), {"min_rows": 8}, "my_ds has 3 rows.*8.*lower total_batch_size"),
        ("not a dataset", {}, "my_ds=.*matches no file"),
        ([["a", "b"]], {}, "my_ds row 0 is a list"),
    ],
)
def test_validate_dataset_errors(dataset, kwargs, pattern):
    with pytest.raises(DatasetError, match=pattern):
        validate_dataset(dataset, name="my_ds", **kwargs)


def test_validate_dataset_accepts_good_inputs(word_tokenizer):
    assert validate_dataset(id_dataset(3), name="d") == "input_ids"
    assert validate_dataset([{"input_ids": np.arange(3)}], name="d") == "input_ids"
    assert validate_dataset([{"text": "a"}], name="d", tokenizer=word_tokenizer) == "text"
    assert issubclass(DatasetError, ValueError)


def test_loader_rejects_bad_arguments():
    with pytest.raises(ValueError, match="not divisible by gradient_accumulation_steps=3"):
        make_loader(id_dataset(16), accumulation_steps=3)
    with pytest.raises(DatasetError, match="dataset_train has 5 rows"):
        make_loader(id_dataset(5))
    with pytest.raises(ValueError, match="pad_token_id.*pad_token"):
        make_loader(id_dataset(16), pad_token_id=None)


def test_prefetch_yields_in_order_and_propagates_errors():
    assert list(prefetch(iter(range(20)), size=3)) == list(range(20))

    def producer():
        yield 1
        yield 2
        raise KeyError("producer broke")

    it = prefetch(producer())
    assert next(it) == 1 and next(it) == 2
    with pytest.raises(KeyError, match="producer broke"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_close_stops_the_thread():
    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    before = threading.active_count()
    with prefetch(endless(), size=2) as it:
        assert next(it) == 0
    time.sleep(0.1)
    count = len(produced)
    time.sleep(0.2)
    assert len(produced) == count <= 5  # bounded queue, and nothing produced after close
    assert threading.active_count() == before


def test_prefetch_of_loader_matches_direct_iteration():
    ds = id_dataset(20)
    direct = take(make_loader(ds).batches(), 4)
    with prefetch(make_loader(ds).batches()) as it:
        ahead = take(it, 4)
    for x, y in zip(direct, ahead):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])

"""Every accepted input type yields the same batches; unreadable files are named."""

from __future__ import annotations

import json
import os

import datasets
import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.data import DatasetError, as_source, build_train_loader, load_files

TEXTS = ["a b c", "d e", "f g h a", "b", "c d e f g", "h h", "a a a", "e f"]


def args(**kw) -> TrainingArguments:
    base = dict(total_batch_size=4, max_sequence_length=6, shuffle_train=False,
                progress_bar="none")  # fmt: skip
    return TrainingArguments(**(base | kw))


def first_batches(data, tokenizer, **kw):
    it = build_train_loader(args(**kw), data, tokenizer=tokenizer).batches()
    return [next(it) for _ in range(2)]


def write_files(tmp_path, fmt: str) -> str:
    """TEXTS split over two shards of format ``fmt``; returns a glob."""
    halves = [TEXTS[:4], TEXTS[4:]]
    for i, part in enumerate(halves):
        path = tmp_path / f"shard-{i}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        elif fmt == "json":
            path.write_text(json.dumps([{"text": t} for t in part]))
        elif fmt == "csv":
            path.write_text("text\n" + "".join(f"{t}\n" for t in part))
        elif fmt == "txt":
            path.write_text("".join(f"{t}\n" for t in part))
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": part}), path)
        elif fmt == "arrow":
            table = pa.table({"text": part})
            with pa.ipc.new_stream(str(path), table.schema) as writer:
                writer.write_table(table)
    return str(tmp_path / f"shard-*.{fmt}")


@pytest.fixture(scope="module")
def reference(chat_tokenizer):
    return first_batches([{"text": t} for t in TEXTS], chat_tokenizer)


def check(batches, reference):
    for x, y in zip(batches, reference):
        for key in y:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "txt", "parquet", "arrow"])
def test_local_files_of_each_format(tmp_path, fmt, chat_tokenizer, reference):
    pattern = write_files(tmp_path, fmt)
    check(first_batches(pattern, chat_tokenizer), reference)
    streamed = first_batches(pattern, chat_tokenizer, streaming=True, max_steps=5,
                             shuffle_train=False)  # fmt: skip
    check(streamed, reference)


def test_hf_grain_and_iterables(chat_tokenizer, reference):
    rows = [{"text": t} for t in TEXTS]
    hf = datasets.Dataset.from_list(rows)
    inputs = {
        "hf Dataset": hf,
        "hf IterableDataset": hf.to_iterable_dataset(num_shards=2),
        "grain MapDataset": grain.MapDataset.source(rows),
        "grain IterDataset": grain.MapDataset.source(rows).to_iter_dataset(),
        "tuple of dicts": tuple(rows),
        "generator function": _Rows(rows),
    }
    for name, data in inputs.items():
        extra = {} if as_source(data, name="d").random_access else {"max_steps": 5}
        try:
            check(first_batches(data, chat_tokenizer, **extra), reference)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from exc


class _Rows:
    """A re-iterable: every iter() starts over (like a generator function)."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        yield from self.rows


def test_one_shot_iterator_trains_one_epoch_then_says_why_not_more(chat_tokenizer):
    loader = build_train_loader(
        args(max_steps=10), iter([{"text": t} for t in TEXTS]), tokenizer=chat_tokenizer
    )
    it = loader.batches()
    next(it), next(it)
    with pytest.raises(DatasetError, match="one-shot iterator.*re-iterable"):
        next(it)


def test_unreadable_and_unknown_files_are_named(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "a"}\n')
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "a"}\nthis is not json\n')
    # The reader's own error was "An error occurred while generating the dataset".
    said = r"b.jsonl line 2 is not valid JSON \(Expecting value, column 1\)"
    with pytest.raises(DatasetError, match=said):
        load_files(str(tmp_path / "*.jsonl"), name="dataset_train")
    with pytest.raises(DatasetError, match=said):
        load_files(str(tmp_path / "*.jsonl"), name="dataset_train", streaming=True)
    bad.write_text("")  # was "StopIteration: ."
    with pytest.raises(DatasetError, match="b.jsonl is empty; give it rows or remove it"):
        load_files(str(bad), name="dataset_train")
    locked = tmp_path / "c.parquet"
    locked.write_bytes(b"x")
    if os.geteuid() != 0:
        locked.chmod(0)
        with pytest.raises(DatasetError, match="cannot read file .*c.parquet"):
            load_files(str(locked), name="dataset_train")
    with pytest.raises(DatasetError, match="dataset_train='nope/\\*.jsonl' matches no file"):
        load_files("nope/*.jsonl", name="dataset_train")
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DatasetError, match="d.xml.*supported formats"):
        load_files(str(tmp_path / "d.xml"), name="dataset_train")


@pytest.mark.parametrize(
    "suffix, row",
    [(".jsonl", b'{"text": "caf\xe9"}\n'), (".txt", b"caf\xe9\n"), (".csv", b"caf\xe9\n")],
)
def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_column(tmp_path, suffix, row):
    """A Latin-1 byte in a .jsonl once died in pyarrow with a traceback naming nothing (a .txt
    or .csv said only "An error occurred while generating the dataset")."""
    head = (
        b'{"text": "fine"}\n' if suffix == ".jsonl" else b"text\n" if suffix == ".csv" else b"ok\n"
    )
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(head * 3 + row)
    column = row.index(b"\xe9") + 1
    for streaming in (False, True):
        with pytest.raises(DatasetError, match=rf"latin1{suffix} line 4, column {column}: byte "
                           r"0xe9 is not UTF-8 text; re-encode"):  # fmt: skip
            load_files(str(path), name="dataset_train", streaming=streaming)


def test_tfds_missing_gives_install_hint():
    pytest.importorskip("jaxtrain")
    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        from jaxtrain.data import tfds_source

        with pytest.raises(DatasetError, match=r"pip install 'jaxtrain\[tfds\]'"):
            tfds_source("mnist")
    else:
        pytest.skip("tensorflow-datasets is installed")


def test_a_jsonl_column_of_mixed_types_names_its_row(tmp_path):
    """One number among strings sent the file through pandas, which read the strings " 3"
    as numbers: the error then named row 2 with a value the file does not hold."""
    rows = [{"prompt": "p", "chosen": f" {i}", "rejected": "r"} for i in range(12)]
    rows[10]["chosen"] = 5
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        DatasetError, match=r"column 'chosen' holds strings, then a number in row 10"
    ):
        load_files(str(path), name="dataset_train")


@pytest.mark.parametrize("streaming", [False, True])
def test_csv_replies_that_look_like_numbers_stay_text(tmp_path, streaming):
    """A CSV reader types each column by its cells: replies "4" and "007" became the numbers
    4 and 7 (the row checks then refused an int where text was due); other columns keep the
    reader's types."""
    path = tmp_path / "pairs.csv"
    path.write_text("prompt,chosen,rejected,margin\n2 + 2 ?,4,007,1.5\n1 + 1 ?,2,3,0\n")
    rows = list(load_files(str(path), name="data.train_files", streaming=streaming))
    assert rows[0] == {"prompt": "2 + 2 ?", "chosen": "4", "rejected": "007", "margin": 1.5}
    assert rows[1]["margin"] == 0.0

"""Small jsonl and txt files are read without `datasets` (data/arrow_rows.py): the same rows
and columns as `datasets.load_dataset` gives for them, the same up-front checks, and
`datasets` still reads what the fast path does not."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import numpy as np
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.data import (
    DatasetError,
    arrow_rows,
    build_eval_loader,
    build_train_loader,
    load_files,
)
from jaxtrain.data.arrow_rows import ArrowRows

ROWS = [
    {"input_ids": [3, 1, 4, 1, 5], "labels": [-100, 1, 4, 1, 5], "text": "pi"},
    {"input_ids": [9, 2], "labels": [9, 2], "text": "naïve – ünïcode"},
    {"input_ids": [], "labels": [], "text": ""},
]


def by_datasets(builder: str, paths: list[str]) -> list[dict]:
    return list(datasets.load_dataset(builder, data_files=paths, split="train"))


def test_jsonl_rows_equal_the_datasets_rows(tmp_path):
    paths = []
    for shard in range(2):  # two shards of one schema: concatenated in order
        path = tmp_path / f"part-{shard}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[shard:]))
        paths.append(str(path))
    rows = load_files(str(tmp_path / "*.jsonl"), name="data.train_files")
    assert isinstance(rows, ArrowRows)
    want = by_datasets("json", paths)
    assert list(rows) == want and len(rows) == 5
    assert rows.column_names == ["input_ids", "labels", "text"]
    assert rows[-1] == want[-1] and rows[1:3] == want[1:3]
    assert rows.rows([4, 0, 2]) == [want[4], want[0], want[2]]
    with pytest.raises(IndexError):
        rows[5]


def test_text_lines_equal_the_datasets_lines(tmp_path):
    path = tmp_path / "lines.txt"
    # CRLF and CR line ends, an empty line, a form feed inside a line, no final newline
    path.write_bytes("first\r\nsecond\rthird\n\nfor\x0cm feed\nünïcode last".encode())
    rows = load_files(str(path), name="data.train_files")
    assert isinstance(rows, ArrowRows)
    assert list(rows) == by_datasets("text", [str(path)])
    assert [r["text"] for r in rows][:3] == ["first", "second", "third"]


def test_what_the_fast_path_does_not_read_goes_through_datasets(tmp_path, monkeypatch):
    one_document = tmp_path / "rows.json"  # a JSON array, not lines
    one_document.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert list(load_files(str(one_document), name="d")) == [{"text": "a"}, {"text": "b"}]
    mixed = [tmp_path / "m0.jsonl", tmp_path / "m1.jsonl"]  # columns differ between files
    mixed[0].write_text('{"text": "a"}\n')
    mixed[1].write_text('{"text": "b", "extra": 1}\n')
    assert arrow_rows.read_small_files("json", [str(p) for p in mixed]) is None
    big = tmp_path / "big.jsonl"
    big.write_text('{"text": "a"}\n' * 100)
    monkeypatch.setattr(arrow_rows, "SMALL_FILES_BYTES", 64)
    loaded = load_files(str(big), name="d")
    assert isinstance(loaded, datasets.Dataset) and len(loaded) == 100


def test_a_bad_line_is_still_named_with_its_file(tmp_path):
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    good.write_text('{"text": "a"}\n')
    bad.write_text('{"text": "a"}\n{"text": "unterminated\n')
    with pytest.raises(DatasetError, match="b.jsonl"):
        load_files(str(tmp_path / "*.jsonl"), name="data.train_files")


def test_token_rows_from_a_file_are_checked_whole_before_training(tmp_path):
    rows = [{"input_ids": [1 + i % 40, 2, 3, 4]} for i in range(400)]
    rows[371] = {"input_ids": [5, 62, 7]}
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_files(str(path), name="data.train_files")
    assert isinstance(loaded, ArrowRows)
    arguments = TrainingArguments(total_batch_size=2, max_sequence_length=8, max_steps=3)
    for build in (build_train_loader, build_eval_loader):
        with pytest.raises(DatasetError, match="row 371.*'input_ids' holds token id 62"):
            build(arguments, loaded, vocab_size=50)


def test_batches_from_file_rows_equal_batches_from_the_datasets_rows(tmp_path):
    path = tmp_path / "tokens.jsonl"
    rng = np.random.default_rng(0)
    lines = [{"input_ids": rng.integers(0, 50, rng.integers(2, 12)).tolist()} for _ in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    arguments = TrainingArguments(total_batch_size=4, max_sequence_length=8, max_steps=5)

    def batches(dataset) -> list[dict]:
        loader = build_train_loader(arguments, dataset, vocab_size=50)
        it = loader.batches()
        return [next(it) for _ in range(5)]

    ours = batches(load_files(str(path), name="d"))
    theirs = batches(datasets.load_dataset("json", data_files=[str(path)], split="train"))
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_reading_a_small_file_does_not_import_datasets(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    code = (
        "import sys; from jaxtrain.data import load_files, as_source; "
        f"rows = load_files({str(path)!r}, name='d'); "
        "as_source(rows, name='d').read([2, 0]); "
        "print(len(rows), 'datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "False"]

"""Determinism, exact resume and per-process sharding for every loader kind."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.data import DatasetError, build_train_loader

T = 8


def docs(n: int) -> list[dict]:
    """Document i is tokens (i + 1) repeated 1 + i % 5 times: recognisable and varied."""
    return [{"input_ids": [i + 1] * (1 + i % 5)} for i in range(n)]


def args(**kw) -> TrainingArguments:
    base = dict(total_batch_size=4, gradient_accumulation_steps=2, max_sequence_length=T,
                seed=7, max_steps=100, stream_window=8, progress_bar="none")  # fmt: skip
    return TrainingArguments(**(base | kw))


def as_input(kind: str, rows: list[dict]):
    if kind == "map":
        return datasets.Dataset.from_list(rows)
    if kind == "hf_stream":
        return datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=2)
    return rows  # "list": with streaming=True read as a stream


CASES = [  # (input kind, TrainingArguments overrides)
    ("map", {}),
    ("map", {"packing": True}),
    ("hf_stream", {}),
    ("hf_stream", {"packing": True}),
    ("map", {"packing": True, "packing_window": 4}),  # many blocks, resumed inside one
    ("list", {"streaming": True, "packing": True}),
]


def take(loader, k, start=0):
    it = loader.batches(start_step=start)
    return [next(it) for _ in range(k)]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.parametrize(("kind", "extra"), CASES)
def test_same_seed_same_batches_other_seed_differs(kind, extra):
    a = take(build_train_loader(args(**extra), as_input(kind, docs(40))), 6)
    b = take(build_train_loader(args(**extra), as_input(kind, docs(40))), 6)
    c = take(build_train_loader(args(seed=8, **extra), as_input(kind, docs(40))), 6)
    assert_same(a, b)
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))
    if extra.get("packing"):
        assert {"segment_ids", "positions"} <= set(a[0])


@pytest.mark.parametrize(("kind", "extra"), CASES)
def test_resume_after_k_batches_equals_uninterrupted(kind, extra):
    """Stop after k batches (across an epoch boundary), save the state as a checkpoint
    would (JSON), restore it into a fresh loader: the next batches are the uninterrupted ones."""
    n_docs, k, more = 30, 9, 6
    whole = take(build_train_loader(args(**extra), as_input(kind, docs(n_docs))), k + more)
    first = build_train_loader(args(**extra), as_input(kind, docs(n_docs)))
    assert_same(take(first, k), whole[:k])
    saved = json.loads(json.dumps(first.data_state(k)))
    fresh = build_train_loader(args(**extra), as_input(kind, docs(n_docs)))
    assert fresh.check_data_state(saved) == k
    assert_same(take(fresh, more, start=k), whole[k:])


def long_docs(n: int) -> list[dict]:
    """Document i: 1 + (3 * i) % 20 tokens (rows of 8: about half are split)."""
    return [{"input_ids": [i + 1] * (1 + (3 * i) % 20)} for i in range(n)]


@pytest.mark.parametrize("kind", ["map", "hf_stream"])
def test_split_documents_resume_exactly_and_stay_apart(kind):
    n_docs, k, more = 24, 7, 5
    a = args(packing=True, packing_window=6)
    whole = take(build_train_loader(a, as_input(kind, long_docs(n_docs))), k + more)
    first = build_train_loader(a, as_input(kind, long_docs(n_docs)))
    assert_same(take(first, k), whole[:k])
    saved = json.loads(json.dumps(first.data_state(k)))
    assert saved["long_documents"] == "split" and saved["packing_window"] == 6
    fresh = build_train_loader(a, as_input(kind, long_docs(n_docs)))
    assert fresh.check_data_state(saved) == k
    assert_same(take(fresh, more, start=k), whole[k:])
    # Every segment holds one document's tokens only (pieces included), positions from 0.
    for b in whole:
        ids, seg, pos = (b[f].reshape(-1, T) for f in ("input_ids", "segment_ids", "positions"))
        for r in range(ids.shape[0]):
            for s in set(seg[r].tolist()) - {0}:
                assert len(set(ids[r][seg[r] == s].tolist())) == 1
                assert pos[r][seg[r] == s].tolist() == list(range(int((seg[r] == s).sum())))
    truncating = build_train_loader(args(packing=True, split_long_documents=False), long_docs(24))
    with pytest.raises(DatasetError, match="long_documents: saved 'split', now 'keep_end'"):
        truncating.check_data_state(saved)


def test_stream_resume_refuses_another_configuration():
    loader = build_train_loader(args(packing=True), docs(30))
    take(loader, 2)
    state = loader.data_state(2)
    other = build_train_loader(args(packing=True, seed=1), docs(30))
    with pytest.raises(DatasetError, match="seed: saved 7, now 1"):
        other.check_data_state(state)


def test_stream_without_state_replays_to_the_start_step():
    whole = take(build_train_loader(args(packing=True), docs(30)), 5)
    later = build_train_loader(args(packing=True), docs(30))
    assert_same(take(later, 2, start=3), whole[3:])


def token_ids(batches) -> list[int]:
    """Document ids in batches (one id per document: its repeated token)."""
    out = []
    for b in batches:
        ids, mask = b["input_ids"].reshape(-1, T), b["attention_mask"].reshape(-1, T)
        seg = b.get("segment_ids")
        for r in range(ids.shape[0]):
            if seg is None:
                if mask[r, 0]:
                    out.append(int(ids[r, 0]))
                continue
            for s in np.unique(seg.reshape(-1, T)[r]):
                if s:
                    out.append(int(ids[r][seg.reshape(-1, T)[r] == s][0]))
    return out


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("map", {"drop_last": False}), ("map", {"packing": True}), ("hf_stream", {})],
)
def test_two_processes_read_disjoint_shares_covering_the_epoch(kind, extra):
    n = 24
    a = args(total_batch_size=4, **extra)
    loaders = [
        build_train_loader(a, as_input(kind, docs(n)), process_index=p, process_count=2)
        for p in (0, 1)
    ]
    shares = []
    for loader in loaders:
        assert next(loader.batches())["input_ids"].shape[:2] == (2, 1)  # 2 rows / 2 processes
        if hasattr(loader, "steps_per_epoch") and loader.steps_per_epoch:
            it = loader.batches()
            ids = token_ids([next(it) for _ in range(loader.steps_per_epoch)])
        else:  # packed or streamed: the documents of epoch 0 of this process's unit stream
            ids = []
            for (epoch, _), example in loader.units.iterate():
                if epoch:
                    break
                ids.append(int(example["input_ids"][0]))
        shares.append(ids)
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(1, n + 1))


def test_dataset_smaller_than_one_global_batch():
    with pytest.raises(DatasetError, match="dataset_train has 3 rows.*needs 4 rows"):
        build_train_loader(args(max_steps=-1), docs(3))
    with pytest.raises(DatasetError, match="fewer documents.*than one global batch"):
        next(build_train_loader(args(streaming=True), docs(3)).batches())


def test_each_process_resumes_its_own_stream_position():
    a = args(packing=True)
    hosts = [build_train_loader(a, docs(30), process_index=p, process_count=2) for p in (0, 1)]
    whole = [take(h, 5) for h in hosts]
    first = [build_train_loader(a, docs(30), process_index=p, process_count=2) for p in (0, 1)]
    for h in first:
        take(h, 3)
    saved = {"step": 3, "processes": [h.data_state(3) for h in first]}
    for p in (0, 1):
        fresh = build_train_loader(a, docs(30), process_index=p, process_count=2)
        assert fresh.check_data_state(saved) == 3
        assert_same(take(fresh, 2, start=3), whole[p][3:])

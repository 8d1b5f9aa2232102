"""Weighted mixtures of train sources: shares, stages, exact resume, per-source settings,
running out, and the one-line errors of bad weights (no JAX here: the loader alone)."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.data import DatasetError, Source, build_mixture_loader
from jaxtrain.data.mixture_schedule import MixtureSchedule
from jaxtrain.errors import ArgumentError

T = 8


def full_rows(n: int, base: int) -> list[dict]:
    """Rows of exactly T tokens (no padding): a row's target tokens are the same for every
    source, so a share of rows is a share of tokens to within a row."""
    return [{"input_ids": [base + (i + j) % 90 for j in range(T)]} for i in range(n)]


def varied_docs(n: int, base: int) -> list[dict]:
    return [{"input_ids": [base + i % 90] * (1 + i % 7)} for i in range(n)]


def args(**kw) -> TrainingArguments:
    base = dict(total_batch_size=16, gradient_accumulation_steps=2, max_sequence_length=T,
                seed=5, max_steps=1000, progress_bar="none")  # fmt: skip
    return TrainingArguments(**(base | kw))


def take(loader, k, start=0):
    it = loader.batches(start_step=start)
    return [next(it) for _ in range(k)]


def token_shares(batches, names):
    """Each source's share of the batches' target tokens."""
    tokens = np.zeros(len(names))
    for b in batches:
        targets = (b["labels"][..., 1:] != -100).sum(-1)
        for k in range(len(names)):
            tokens[k] += targets[b["source_ids"] == k].sum()
    return tokens / tokens.sum()


@pytest.mark.parametrize(
    "weights",
    [
        {"web": 0.7, "code": 0.2, "math": 0.1},
        {"web": 1.0, "code": 1.0, "math": 1.0},  # need not sum to 1
        {"web": 0.05, "code": 0.9, "math": 0.05},
    ],
)
def test_each_source_gets_its_weight_of_the_tokens(weights):
    sources = {
        "web": datasets.Dataset.from_list(full_rows(200, 1)),
        "code": full_rows(50, 100),  # small: many epochs of it
        "math": datasets.Dataset.from_list(full_rows(30, 200)),
    }
    loader = build_mixture_loader(args(mixture_weights=weights), sources)
    batches = take(loader, 100)  # 1600 rows
    total = sum(weights.values())
    for name, share in zip(loader.names, token_shares(batches, loader.names)):
        assert abs(share - weights[name] / total) <= 0.01, (name, share)
    # The schedule is exact in rows: within one slot of the weight at every step.
    slots = np.concatenate([b["source_ids"].reshape(-1) for b in batches])
    for k, name in enumerate(loader.names):
        for steps in (1, 7, 100):
            got = (slots[: 16 * steps] == k).sum()
            assert abs(got - 16 * steps * weights[name] / total) < 1.0 + 1e-9, (name, steps)


def test_shares_of_packed_documents_of_any_length():
    # Packed rows are nearly full whatever the documents' lengths: token shares follow.
    sources = {"a": varied_docs(400, 1), "b": datasets.Dataset.from_list(varied_docs(300, 100))}
    loader = build_mixture_loader(args(packing=True, mixture_weights={"a": 0.6, "b": 0.4}), sources)
    shares = token_shares(take(loader, 60), loader.names)
    np.testing.assert_allclose(shares, [0.6, 0.4], atol=0.01)


def test_staged_weights_switch_at_the_stated_step():
    stages = [[0, {"a": 1.0}], [5, {"a": 0.0, "b": 1.0}], [8, {"a": 1, "b": 1}]]
    sources = {"a": full_rows(40, 1), "b": full_rows(40, 100)}
    loader = build_mixture_loader(args(mixture_weights=stages), sources)
    ids = [b["source_ids"].reshape(-1) for b in take(loader, 10)]
    for step in range(5):  # steps 1..5 (index 0..4): stage 0
        assert (ids[step] == 0).all(), step
    for step in (5, 6, 7):
        assert (ids[step] == 1).all(), step
    for step in (8, 9):
        assert (ids[step] == 0).sum() == (ids[step] == 1).sum() == 8
    # A source's rows continue where they stopped: b's first rows are its order's first.
    first_b = take(build_mixture_loader(args(mixture_weights={"b": 1.0, "a": 0.0}), sources), 1)
    b_rows = take(loader, 6)[5]["input_ids"].reshape(16, T)
    np.testing.assert_array_equal(b_rows, first_b[0]["input_ids"].reshape(16, T))


def as_kind(kind: str, rows: list[dict]):
    if kind == "map":
        return datasets.Dataset.from_list(rows)
    if kind == "stream":
        return datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=2)
    return Source(rows, streaming=True)  # a list read as a stream


@pytest.mark.parametrize("packing", [False, True])
def test_resume_from_a_saved_position_continues_the_same_rows(packing):
    """Stop after k steps, keep the position as a checkpoint does (JSON), restore it into a
    fresh mixture: the next batches are the uninterrupted ones, across source epochs."""

    def sources():
        return {
            "map": as_kind("map", varied_docs(37, 1)),
            "stream": as_kind("stream", varied_docs(23, 100)),
            "list": as_kind("list", varied_docs(19, 200)),
        }

    weights = [[0, {"map": 0.5, "stream": 0.3, "list": 0.2}], [6, {"map": 0.1, "list": 0.9}]]
    settings = args(mixture_weights=weights, packing=packing, packing_window=8)
    k, more = 9, 6
    straight = build_mixture_loader(settings, sources())
    whole = take(straight, k + more)
    first = build_mixture_loader(settings, sources())
    done = take(first, k)
    saved = json.loads(json.dumps(first.data_state(k)))
    assert saved["step"] == k and max(first.source_epochs(k).values()) > 1
    fresh = build_mixture_loader(settings, sources())
    assert fresh.check_data_state(saved) == k
    after = take(fresh, more, start=k)
    for x, y in zip(done + after, whole, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)
    # Each source's epochs and tokens continue too.
    logs = fresh.step_logs(k + more)
    assert logs == straight.step_logs(k + more)
    assert set(logs) == {f"mixture/{n}/{f}" for n in sources() for f in ("epoch", "tokens")}


def test_a_position_from_other_weights_is_refused():
    sources = {"a": full_rows(40, 1), "b": full_rows(40, 100)}
    first = build_mixture_loader(args(mixture_weights={"a": 0.5, "b": 0.5}), sources)
    take(first, 3)
    saved = json.loads(json.dumps(first.data_state(3)))
    other = build_mixture_loader(args(mixture_weights={"a": 0.25, "b": 0.75}), sources)
    with pytest.raises(DatasetError, match="does not fit this mixture .*stages"):
        other.check_data_state(saved)


def test_each_source_reads_its_own_columns_and_chat_settings(chat_tokenizer):
    text = [{"body": "a b c d"}] * 8
    chat = [
        {"conv": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}]}
    ] * 8
    sources = {
        "text": Source(text, text_column="body"),
        "chat": Source(chat, messages_column="conv", completion_only_loss=True),
    }
    settings = args(total_batch_size=4, max_sequence_length=16,
                    mixture_weights={"text": 1, "chat": 1})  # fmt: skip
    (batch,) = take(build_mixture_loader(settings, sources, tokenizer=chat_tokenizer), 1)
    ids, labels, src = batch["input_ids"], batch["labels"], batch["source_ids"]
    text_row = ids[src == 0][0]
    assert chat_tokenizer.decode(text_row[text_row != 0]) == "a b c d"
    chat_labels = labels[src == 1][0]
    learned = chat_tokenizer.decode(chat_labels[chat_labels >= 0])
    assert "bye" in learned and "hi" not in learned  # completion-only: the reply alone


def test_stop_ends_the_mixture_before_a_source_s_second_epoch():
    # 8 slots a step, b has half: b's 20 rows last 5 steps (4 a step); the 6th would repeat.
    sources = {"a": full_rows(100, 1), "b": full_rows(20, 100)}
    settings = args(total_batch_size=8, mixture_weights={"a": 1, "b": 1},
                    mixture_exhausted="stop")  # fmt: skip
    batches = list(build_mixture_loader(settings, sources).batches())
    assert len(batches) == 5
    b_rows = np.concatenate([b["input_ids"][b["source_ids"] == 1] for b in batches])
    assert len({tuple(r) for r in b_rows}) == 20  # each of b's rows exactly once


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": -0.5, "b": 1}, r"mixture_weights\['a'\]=-0.5 is negative"),
        ({"a": 0, "b": 0.0}, "every weight is 0"),
        ({"a": 1, "c": 1}, r"names \['c'\], which dataset_train does not have"),
        ({"a": 1}, r"source\(s\) \['b'\] that TrainingArguments.mixture_weights gives no weight"),
        ([[3, {"a": 1, "b": 1}]], "the first stage starts at step 0"),
        ([[0, {"a": 1}], [0, {"b": 1}]], "stage steps must increase"),
        ({"a": "lots", "b": 1}, r"mixture_weights\['a'\]='lots' must be a number"),
    ],
)
def test_bad_weights_are_one_line_errors(weights, message):
    sources = {"a": full_rows(20, 1), "b": full_rows(20, 100)}
    with pytest.raises(ArgumentError, match=message) as err:
        build_mixture_loader(args(mixture_weights=weights), sources)
    assert "\n" not in str(err.value)


def test_a_mixture_needs_weights_and_max_steps():
    with pytest.raises(ArgumentError, match="give their weights") as err:
        build_mixture_loader(args(), {"a": full_rows(20, 1), "b": full_rows(20, 100)})
    assert "\n" not in str(err.value)
    with pytest.raises(ArgumentError, match="set max_steps"):
        args(max_steps=-1, mixture_weights={"a": 1})
    with pytest.raises(ArgumentError, match="mixture_exhausted='halt' is not supported"):
        args(mixture_weights={"a": 1}, mixture_exhausted="halt")


def test_weights_from_the_command_line_are_parsed():
    parsed = TrainingArguments.from_dict(
        {"mixture_weights": "[[0, {a: 1}], [10, {a: 0.5, b: 0.5}]]", "max_steps": "20"}
    )
    assert parsed.mixture_weights == [[0, {"a": 1}], [10, {"a": 0.5, "b": 0.5}]]
    assert TrainingArguments.from_dict(
        {"mixture_weights": "{a: 0.7, b: 0.3}", "max_steps": "20"}
    ).mixture_weights == {"a": 0.7, "b": 0.3}


def test_the_schedule_never_picks_a_zero_weight_and_interleaves():
    schedule = MixtureSchedule(["a", "b", "c"], ((0, (("a", 2.0), ("b", 1.0), ("c", 0.0))),))
    plan = schedule.plan(0, [0, 0, 0], 3, 3)  # 3 steps of 3 slots
    assert plan.sources.reshape(-1).tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0]
    assert plan.counts[-1] == (6, 3, 0)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("process_index", [0, 1])
def test_a_read_of_several_steps_is_their_batches(drop_last, process_index):
    """rows_at (how a mixture reads a source) gives what batch_at gives step by step, within
    an epoch, across epochs and over a last step completed with filler rows."""
    from jaxtrain.data.loader import BatchLoader

    rows = datasets.Dataset.from_list(full_rows(23, 1))
    loader = BatchLoader(rows, global_batch_size=4, accumulation_steps=2, seq_len=T,
                         pad_token_id=0, seed=3, drop_last=drop_last,
                         process_index=process_index, process_count=2)  # fmt: skip
    for steps in (range(0, 3), range(1, 5), range(4, 13), range(5, 6)):
        got, _ = loader.rows_at(steps)
        for key in got:
            want = np.concatenate([loader.batch_at(s)[0][key].reshape(2, -1) for s in steps])
            np.testing.assert_array_equal(got[key], want, err_msg=f"{key} {steps}")

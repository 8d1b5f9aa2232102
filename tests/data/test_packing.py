"""Packing: packed documents never see each other, with the real model and loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.data import IGNORE_INDEX, pack_row
from jaxtrain.data.packing import Packer, best_fit_decreasing, doc_tokens, split_document
from jaxtrain.models import LlamaConfig, LlamaForCausalLM

T = 24


def per_token_nll(logits, labels):
    """nll[b, t] of predicting labels[b, t + 1] from position t (NaN where ignored)."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    target = labels[:, 1:]
    nll = -jnp.take_along_axis(logp, jnp.maximum(target, 0)[..., None], axis=-1)[..., 0]
    return np.where(np.asarray(target) == IGNORE_INDEX, np.nan, np.asarray(nll))


@nnx.jit
def forward(model, ids, positions=None, segment_ids=None):
    return model(ids, positions=positions, segment_ids=segment_ids)


def test_packed_loss_equals_one_document_per_row():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 64, size=n) for n in (7, 5, 9, 3, 11, 6, 8)]
    packer = Packer(
        (((0, i), {"input_ids": d}) for i, d in enumerate(docs + docs)),
        seq_len=T, pad_token_id=0, truncation_mode="keep_end",
    )  # fmt: skip
    rows = [packer.next_row()[0] for _ in range(3)]
    packed = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    assert (packed["segment_ids"].max(axis=1) >= 2).all()  # several documents per row
    logits = forward(model, packed["input_ids"], packed["positions"], packed["segment_ids"])
    nll_packed = per_token_nll(logits, packed["labels"])

    alone = np.zeros((len(docs), T), np.int32)
    alone_labels = np.full((len(docs), T), IGNORE_INDEX, np.int32)
    for i, d in enumerate(docs):
        alone[i, : len(d)], alone_labels[i, : len(d)] = d, d
    nll_alone = per_token_nll(forward(model, alone), alone_labels)

    # Walk the packed rows document by document and compare every target token.
    compared = 0
    for r in range(3):
        seg = packed["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            span = np.flatnonzero(seg == s)
            (d,) = [
                i for i, doc in enumerate(docs) if np.array_equal(doc, packed["input_ids"][r, span])
            ]
            got = nll_packed[r, span[:-1]]  # predictions made inside the document
            want = nll_alone[d, : len(span) - 1]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            compared += len(span) - 1
    assert compared > 40
    # The boundary token of every document is not a target of the previous one.
    starts = np.flatnonzero(np.diff(packed["segment_ids"][0]) != 0) + 1
    assert (packed["labels"][0, starts] == IGNORE_INDEX).all()

    # Without segment ids and positions the same rows give different losses: the test bites.
    leaky = per_token_nll(forward(model, packed["input_ids"]), packed["labels"])
    assert not np.allclose(np.nan_to_num(leaky), np.nan_to_num(nll_packed), atol=1e-4)


def test_pack_row_fields_and_truncation():
    ids, labels, cut = doc_tokens(
        {"input_ids": np.arange(1, 11), "labels": [-100] * 5 + list(range(6, 11))},
        seq_len=4, truncation_mode="keep_end",
    )  # fmt: skip
    assert cut == 6 and ids.tolist() == [7, 8, 9, 10] and labels.tolist() == [7, 8, 9, 10]
    ids2, _, _ = doc_tokens(
        {"input_ids": np.arange(1, 11)}, seq_len=4, truncation_mode="keep_start"
    )
    assert ids2.tolist() == [1, 2, 3, 4]
    row, stats = pack_row([(ids, labels), (np.array([5, 6]), np.array([5, 6]))],
                          seq_len=8, pad_token_id=0)  # fmt: skip
    assert row["segment_ids"].tolist() == [1, 1, 1, 1, 2, 2, 0, 0]
    assert row["positions"].tolist() == [0, 1, 2, 3, 0, 1, 0, 0]
    assert row["labels"].tolist() == [-100, 8, 9, 10, -100, 6, -100, -100]
    assert row["attention_mask"].tolist() == [1] * 6 + [0, 0] and stats.num_padding_tokens == 2


def lognormal_corpus(n: int = 1500, seed: int = 0) -> list[np.ndarray]:
    """A fixed corpus shaped like the stdlib documents at seq 256: median ~141 tokens, a long
    tail (about 1 in 5 longer than a row)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.lognormal(np.log(141), 0.9, size=n).astype(int), 2)
    return [rng.integers(3, 500, size=k) for k in lengths]


def test_best_fit_packing_fills_at_least_98_percent_of_slots_with_targets():
    corpus = lognormal_corpus()
    seq = 256
    assert np.mean([len(d) > seq for d in corpus]) > 0.1  # splitting matters here
    packer = Packer(
        (((0, i), {"input_ids": d}) for i, d in enumerate(corpus)),
        seq_len=seq, pad_token_id=0, window=1024, seed=3,
    )  # fmt: skip
    rows = []
    with pytest.raises(StopIteration):  # the whole (finite) corpus, in two blocks
        while True:
            rows.append(packer.next_row()[0])
    labels = np.stack([r["labels"] for r in rows])
    # A slot carries a target when the next label is real (the loss predicts labels[t + 1]).
    utilisation = (labels[:, 1:] != IGNORE_INDEX).sum() / labels.size
    assert utilisation >= 0.98, utilisation
    # Nothing was truncated: every token but each document's first is a target once.
    assert (labels != IGNORE_INDEX).sum() == sum(len(d) - 1 for d in corpus)


def test_best_fit_decreasing_places_longest_first_into_the_fullest_row():
    assert best_fit_decreasing([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
    lengths = np.random.default_rng(1).integers(1, 9, size=300).tolist()
    bins = best_fit_decreasing(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    # Any-fit packing leaves at most one row at most half full (else they would have merged).
    assert sum(sum(lengths[i] for i in b) <= 4 for b in bins) <= 1


def test_long_documents_split_into_isolated_pieces_that_keep_every_target():
    doc = np.arange(10, 30)  # 20 tokens, rows of 8
    pieces = split_document(doc, doc.copy(), 8)
    assert [p[0].tolist() for p in pieces] == [
        list(range(10, 18)), list(range(17, 25)), list(range(24, 30)),
    ]  # fmt: skip
    packer = Packer([((0, 0), {"input_ids": doc})], seq_len=8, pad_token_id=0, shuffle=False)
    rows = [packer.next_row() for _ in range(3)]
    targets = []
    for row, stats in rows:
        assert stats.num_truncated_tokens == 0
        seg, pos = row["segment_ids"], row["positions"]
        assert seg.max() == 1  # one piece per row here: each piece is its own document
        assert pos[seg == 1].tolist() == list(range(int((seg == 1).sum())))
        assert row["labels"][0] == IGNORE_INDEX
        targets += [int(t) for t in row["labels"] if t != IGNORE_INDEX]
    assert sorted(targets) == list(range(11, 30))  # every token but the first, once

    truncating = Packer([((0, 0), {"input_ids": doc})], seq_len=8, pad_token_id=0,
                        split_long=False, truncation_mode="keep_start")  # fmt: skip
    row, stats = truncating.next_row()
    assert stats.num_truncated_tokens == 12 and row["input_ids"].tolist() == list(range(10, 18))

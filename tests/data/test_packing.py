"""Packing: packed documents never see each other, with the real model and loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.data import IGNORE_INDEX, pack_row
from jaxtrain.data.packing import Packer, doc_tokens
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
    doc_index = 0
    for r in range(3):
        seg = packed["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            span = np.flatnonzero(seg == s)
            d = doc_index % len(docs)
            np.testing.assert_array_equal(packed["input_ids"][r, span], docs[d])
            got = nll_packed[r, span[:-1]]  # predictions made inside the document
            want = nll_alone[d, : len(span) - 1]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            compared += len(span) - 1
            doc_index += 1
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

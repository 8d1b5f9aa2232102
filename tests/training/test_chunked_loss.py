"""Chunked cross-entropy: the same sums and gradients, without whole-batch logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.config.sections import RunSettings
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.trainers.dpo import DPOArguments, dpo_loss_sums
from jaxtrain.training import logps
from jaxtrain.training.logps import (
    CHUNKED_LOSS_MIN_VOCAB,
    chunked_token_logps,
    sequence_logps,
    token_logps,
)
from jaxtrain.training.step import (
    IGNORE_INDEX,
    causal_lm_loss_sums,
    causal_lm_sums,
    chunked_causal_lm_sums,
)

B, T = 2, 13


def largest_logits(jaxpr, vocab: int, hidden: int) -> int:
    """Elements of the largest logits-like value ([..., vocab], not a [hidden, vocab] weight
    or its gradient) in a jaxpr, sub-jaxprs (scan, remat) included."""
    big = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = getattr(var.aval, "shape", ())
            if shape and shape[-1] == vocab and hidden not in shape:
                big = max(big, int(np.prod(shape)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    big = max(big, largest_logits(inner, vocab, hidden))
    return big


@pytest.fixture(scope="module")
def setup():
    config = LlamaConfig(vocab_size=CHUNKED_LOSS_MIN_VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         initializer_range=0.2)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    labels = ids.copy()
    labels[0, :4] = IGNORE_INDEX
    return model, {"input_ids": jnp.asarray(ids), "labels": jnp.asarray(labels)}


def full_sums(model, batch):
    return causal_lm_sums(model(batch["input_ids"]), batch["labels"])


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_sums_and_grads_equal_the_full_logits(setup, tied):
    model, batch = setup
    if tied:
        model = LlamaForCausalLM(
            LlamaConfig(**{**model.config.to_dict(), "tie_word_embeddings": True}),
            rngs=nnx.Rngs(1),
        )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, fn):
        sums = fn(nnx.merge(graphdef, p, rest), batch)
        return sums["loss_sum"], sums

    def chunked(m, b):  # chunks of 3 positions of each of the 2 rows, the last padded
        h = m.hidden_states(b["input_ids"])
        return chunked_causal_lm_sums(h, m.output_projection(), b["labels"], chunk_tokens=5)

    def trainer_default(m, b):  # the Trainer's default loss: chunked at this vocabulary
        return causal_lm_loss_sums(m, b, None)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (want, want_sums), want_g = grad(params, full_sums)
    for fn in (chunked, trainer_default):
        (got, sums), g = grad(params, fn)
        assert sorted(sums) == ["correct", "loss_sum", "tokens"]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        assert float(sums["tokens"]) == float(want_sums["tokens"]) == B * (T - 1) - 3
        assert float(sums["correct"]) == float(want_sums["correct"])
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)

    # No value of the chunked gradient computation is as large as the batch's logits.
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, chunked)[0]))(params).jaxpr
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    # A chunk holds every row (they stay split over the batch axes), -(-5 // B) positions each.
    assert largest_logits(jaxpr, vocab, hidden) == B * -(-5 // B) * vocab
    full = jax.make_jaxpr(jax.grad(lambda p: loss(p, full_sums)[0]))(params).jaxpr
    assert largest_logits(full, vocab, hidden) >= B * (T - 1) * vocab  # the check can fail


def test_chunked_sequence_logps_equal_the_full_logits(setup):
    """DPO's per-row log-probabilities at a large vocabulary: same values and gradients."""
    model, batch = setup
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def full(m, ids, labels):
        logp, mask = token_logps(m(ids), labels)
        return logp.sum(-1), mask.sum(-1).astype(jnp.float32)

    def chunked(m, ids, labels):  # chunks of 5 positions of each of the 2 rows
        h = m.hidden_states(ids)
        logp, mask = chunked_token_logps(h, m.output_projection(), labels, chunk_tokens=10)
        return logp.sum(-1), mask.sum(-1).astype(jnp.float32)

    def total(p, fn):
        logp, tokens = fn(nnx.merge(graphdef, p, rest), batch["input_ids"], batch["labels"])
        return (logp * jnp.arange(1.0, B + 1)).sum(), (logp, tokens)

    grad = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)
    (_, (want, want_tokens)), want_g = grad(params, full)
    for fn in (chunked, sequence_logps):  # sequence_logps: chunked at this vocabulary
        (_, (got, tokens)), g = grad(params, fn)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_array_equal(tokens, want_tokens)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: total(p, chunked)[0]))(params).jaxpr
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert largest_logits(jaxpr, vocab, hidden) == B * 5 * vocab


def test_chunked_token_logps_take_a_per_token_cotangent(setup):
    """GRPO's case: per-token log-probs [B, T-1] weighted per token (an advantage times a
    completion mask), chunked: the same values, mask and gradients as whole logits."""
    model, batch = setup
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(B, T - 1)), jnp.float32)

    def chunked(m, ids, labels):  # 4 chunks of 7 positions, across the rows, the last padded
        return chunked_token_logps(m.hidden_states(ids), m.output_projection(), labels,
                                   chunk_tokens=7)  # fmt: skip

    def total(p, fn):
        logp, mask = fn(nnx.merge(graphdef, p, rest), batch["input_ids"], batch["labels"])
        return (logp * weights).sum(), (logp, mask)

    grad = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)
    (_, (want, want_mask)), want_g = grad(
        params, lambda m, ids, labels: token_logps(m(ids), labels)
    )
    (_, (got, mask)), g = grad(params, chunked)
    assert got.shape == mask.shape == (B, T - 1)
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def whole_logits_of(model):
    return lambda input_ids: model(input_ids)


def test_dpo_at_a_large_vocabulary_never_builds_whole_logits(setup, monkeypatch):
    """DPOTrainer's objective (policy and reference) at vocab >= CHUNKED_LOSS_MIN_VOCAB: the
    loss and gradients of whole-batch logits, without a [2N, T, V] float32 array."""
    model, _ = setup
    monkeypatch.setattr(logps, "CHUNK_LOGITS", 64 * CHUNKED_LOSS_MIN_VOCAB)  # 64 positions
    n, t = 2, 65  # 2 pairs: 4 rows, 256 predicting positions, 4 chunks
    rng = np.random.default_rng(3)
    ids = rng.integers(0, CHUNKED_LOSS_MIN_VOCAB, (2, n, t)).astype(np.int32)
    labels = ids.copy()
    labels[:, :, :20] = IGNORE_INDEX  # the prompt
    labels[1, 0, 50:] = IGNORE_INDEX  # a shorter rejected response
    real = np.ones((2, n, t), np.int32)
    real[1, 0, 50:] = 0  # its padding
    pairs = {"input_ids": ids[0], "rejected_input_ids": ids[1], "labels": labels[0],
             "rejected_labels": labels[1], "attention_mask": real[0],
             "rejected_attention_mask": real[1]}  # fmt: skip
    pairs = {k: jnp.asarray(v) for k, v in pairs.items()}
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_params = jax.tree.map(lambda x: x * 0.9, params)  # a reference that differs
    args = DPOArguments(beta=0.5, output_dir="unused")

    def loss(p, ref_p, whole):
        policy, reference = (nnx.merge(graphdef, x, rest) for x in (p, ref_p))
        if whole:  # plain callables, without hidden_states: whole-batch logits
            policy, reference = (whole_logits_of(m) for m in (policy, reference))
        sums = dpo_loss_sums(policy, reference, pairs, RunSettings.from_arguments(args).task)
        return sums["loss_sum"], sums

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)
    compiled = {w: grad.lower(params, ref_params, w).compile() for w in (False, True)}
    (want, want_sums), want_g = compiled[True](params, ref_params)
    (got, sums), g = compiled[False](params, ref_params)
    # float32 logits of [rows, 16] chunks against [rows, 64]: XLA blocks the matmuls
    # differently, which moves the sum of 180 log-probs by ~1e-5 relative.
    np.testing.assert_allclose(got, want, rtol=3e-5)
    for key in want_sums:
        np.testing.assert_allclose(sums[key], want_sums[key], rtol=3e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5)

    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    whole_logits = 2 * n * t * vocab
    chunked = jax.make_jaxpr(lambda p: jax.grad(lambda p: loss(p, ref_params, False)[0])(p))
    assert largest_logits(chunked(params).jaxpr, vocab, hidden) == 64 * vocab
    full = jax.make_jaxpr(lambda p: jax.grad(lambda p: loss(p, ref_params, True)[0])(p))
    assert largest_logits(full(params).jaxpr, vocab, hidden) >= whole_logits  # can fail
    # XLA's buffers agree: the compiled chunked program's scratch is less than one
    # [2N, T, V] float32 array; the whole-logits program's is more.
    temps = {w: c.memory_analysis().temp_size_in_bytes for w, c in compiled.items()}
    print("DPO temp bytes (chunked, whole):", temps[False], temps[True])
    assert temps[False] < 4 * whole_logits < temps[True]


def test_fused_chunks_give_the_gradient_of_whatever_is_differentiated():
    """The chunked loss forms its gradients in the forward pass: for the hidden states
    alone (a frozen head, as with LoRA), for the head too, and under an outer scale."""
    rng = np.random.default_rng(1)
    d, vocab = 8, 64
    h = jnp.asarray(rng.normal(size=(2, 9, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32)
    labels = rng.integers(0, vocab, (2, 9)).astype(np.int32)
    labels[1, 3] = IGNORE_INDEX

    def chunked(h, w):  # 4 chunks of 4 positions, the last padded
        sums = chunked_causal_lm_sums(h, lambda x: x @ w, jnp.asarray(labels), chunk_tokens=4)
        return 0.5 * sums["loss_sum"] + sums["tokens"]  # counts carry no gradient

    def full(h, w):
        sums = causal_lm_sums(h @ w, jnp.asarray(labels))
        return 0.5 * sums["loss_sum"] + sums["tokens"]

    for argnums in (0, (0, 1)):
        got = jax.jit(jax.value_and_grad(chunked, argnums=argnums))(h, w)
        want = jax.value_and_grad(full, argnums=argnums)(h, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_entropy_from_the_chunked_pass_equals_a_direct_softmax(setup):
    """Per-token entropies of the labelled positions, from the same chunked pass as the
    log-probs (and from whole logits), equal -sum p log p of a direct softmax; no gradient
    flows through them and the log-probs are unchanged."""
    model, batch = setup
    ids, labels = batch["input_ids"], batch["labels"]
    logits = np.asarray(model(ids), np.float64)[:, :-1]
    logp_all = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
               keepdims=True)) - logits.max(-1, keepdims=True)  # fmt: skip
    mask = np.asarray(labels[:, 1:]) != IGNORE_INDEX
    want = np.where(mask, -(np.exp(logp_all) * logp_all).sum(-1), 0.0)
    want_logp, _ = token_logps(model(ids), labels)
    h = model.hidden_states(ids)
    chunked = chunked_token_logps(h, model.output_projection(), labels, chunk_tokens=10,
                                  entropy=True)  # fmt: skip
    for logp, got_mask, ent in (chunked, token_logps(model(ids), labels, entropy=True),
                                logps.model_token_logps(model, ids, labels, entropy=True)):  # fmt: skip
        np.testing.assert_allclose(ent, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got_mask, mask)
        np.testing.assert_allclose(logp, want_logp, rtol=1e-6)
    assert want[mask].min() > 1.0  # a real distribution over 32k tokens, not a constant

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def mean_entropy(p):
        m = nnx.merge(graphdef, p, rest)
        return chunked_token_logps(m.hidden_states(ids), m.output_projection(), labels,
                                   chunk_tokens=10, entropy=True)[2].sum()  # fmt: skip

    for g in jax.tree.leaves(jax.grad(mean_entropy)(params)):
        assert not np.asarray(g).any()

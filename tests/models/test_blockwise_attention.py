"""Blockwise attention (models/blockwise.py) against the dense path: outputs and gradients
for every mask, block skipping, the model switches, long positions and the absence of
T x T (and T x vocab) buffers in a long-row train step."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.models.attention import (
    BLOCKWISE_MIN_LENGTH,
    causal_attention,
    causal_mask,
    grouped_attention,
)
from jaxtrain.models.blockwise import (
    AttentionSpec,
    blocked_tokens,
    blockwise_attention,
    default_blocks,
    needed_blocks,
)
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel
from jaxtrain.models.layers import rope_cos_sin, rope_inv_freq
from jaxtrain.trainers.reward import RewardModel
from jaxtrain.trainers.sequences import PAIR_SIDES, _rows, sequence_logps
from jaxtrain.training.logps import CHUNK_LOGITS
from jaxtrain.training.step import causal_lm_loss_sums, model_segment_ids

RTOL, ATOL = 1e-5, 1e-6


def packed_segments(b: int, t: int) -> np.ndarray:
    """Row 0: documents of 10, 1 (a one-token document), 17 tokens, then padding (segment
    0); row 1: one document of the whole row."""
    row = np.array([1] * 10 + [2] + [3] * 17 + [0] * (t - 28))
    return np.stack([row] + [np.full(t, 5)] * (b - 1)).astype(np.int32)


def random_qkv(t: int, n: int = 4, kv: int = 2, h: int = 8, b: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    return q, k, v, cot


CASES = {
    "causal": {},
    "window": dict(sliding_window=6),
    "packed": dict(segments=True),
    "packed_window": dict(segments=True, sliding_window=4),
    "softcap": dict(logit_cap=2.0, scale=0.3),
    "all": dict(segments=True, sliding_window=9, logit_cap=3.0),
    "mqa": dict(kv=1),
    "mha": dict(kv=4),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("blocks", [(8, 16), (16, 8), (64, 64)])
def test_blockwise_equals_dense_outputs_and_gradients(name, blocks):
    case = dict(CASES[name])
    t = 37  # not a multiple of any block size
    q, k, v, cot = random_qkv(t, kv=case.pop("kv", 2))
    seg = jnp.asarray(packed_segments(2, t)) if case.pop("segments", False) else None
    window, cap, scale = case.get("sliding_window"), case.get("logit_cap"), case.get("scale")
    # What padding queries get is read by nothing (their labels are masked): a block of them
    # alone is skipped. Outputs are compared, and gradients taken, on the real tokens.
    real = jnp.ones((2, t, 1, 1)) if seg is None else (seg > 0)[:, :, None, None]
    cot = cot * real

    def dense(q, k, v):
        mask = causal_mask(t, segment_ids=seg, sliding_window=window)
        return grouped_attention(q, k, v, mask, scale=scale, logit_cap=cap)

    def blockwise(q, k, v):
        return blockwise_attention(
            q, k, v, segment_ids=seg, sliding_window=window, scale=scale, logit_cap=cap,
            block_q=blocks[0], block_k=blocks[1],
        )  # fmt: skip

    # Compiled whole: run op by op, every primitive of the block loop compiled on its own.
    def loss_and_grads(fn):
        loss = jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=(0, 1, 2))
        return jax.jit(loss)(q, k, v)

    np.testing.assert_allclose(
        jax.jit(blockwise)(q, k, v) * real, jax.jit(dense)(q, k, v) * real, rtol=RTOL, atol=ATOL
    )
    (want_loss, want), (got_loss, got) = loss_and_grads(dense), loss_and_grads(blockwise)
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_bfloat16_inputs_stay_close_to_dense():
    q, k, v, _ = random_qkv(40)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = blockwise_attention(q, k, v, block_q=16, block_k=16)
    want = grouped_attention(q, k, v, causal_mask(40))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=3e-2)


def needed(seg: np.ndarray, t: int, block: int, window: int | None = None) -> np.ndarray:
    spec = AttentionSpec(block_q=block, block_k=block, scale=1.0, window=window)
    s = blocked_tokens(jnp.asarray(seg), block)
    zero = jnp.zeros((), jnp.int32)
    need, first, last = needed_blocks(zero, zero, s, s, t, spec)
    need = np.asarray(need)
    for i, row in enumerate(need):  # the loop span covers exactly the needed blocks
        cols = np.flatnonzero(row)
        span = (cols.min(), cols.max()) if cols.size else (0, -1)  # none: an empty loop
        assert (first[i], last[i]) == span
    return need


def test_blocks_hidden_by_the_mask_are_skipped():
    t, block = 64, 16
    one = np.ones((1, t), np.int32)
    np.testing.assert_array_equal(needed(one, t, block), np.tril(np.ones((4, 4), bool)))
    # A window of 16 needs only the diagonal and the block just before it.
    band = np.tril(np.ones((4, 4), bool)) & ~np.tril(np.ones((4, 4), bool), -2)
    np.testing.assert_array_equal(needed(one, t, block, window=16), band)
    # Two documents of 32 tokens: blocks of the other document are never computed.
    docs = np.repeat(np.array([[1, 2]], np.int32), 32, axis=1)
    want = np.tril(np.ones((4, 4), bool))
    want[2:, :2] = False
    np.testing.assert_array_equal(needed(docs, t, block), want)
    # Padding (segment 0) makes no block needed: a row of 20 tokens padded to 64 needs the
    # blocks of its first two, a row of padding alone none.
    padded = np.array([[1] * 20 + [0] * 44, [0] * t], np.int32)
    want = np.zeros((4, 4), bool)
    want[:2, :2] = np.tril(np.ones((2, 2), bool))
    np.testing.assert_array_equal(needed(padded, t, block), want)


def test_padding_blocks_are_not_computed_and_real_tokens_see_the_same():
    t, block = 64, 16
    q, k, v, cot = random_qkv(t)
    seg = jnp.asarray(np.array([[1] * 20 + [0] * 44, [1] * 40 + [0] * 24], np.int32))
    real = (seg > 0)[:, :, None, None]

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cot * real), (0, 1, 2)))

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, segment_ids=seg, block_q=block, block_k=block)

    def unpadded(q, k, v):  # no segments: every block of the causal triangle is computed
        return blockwise_attention(q, k, v, block_q=block, block_k=block)

    out = jax.jit(blockwise)(q, k, v)
    np.testing.assert_allclose(out * real, jax.jit(unpadded)(q, k, v) * real, rtol=RTOL, atol=ATOL)
    # Blocks are skipped for the whole batch: the last one is padding in both rows, and its
    # queries saw no key (zeros, not NaN).
    assert np.all(np.asarray(out[:, 3 * block :]) == 0) and np.isfinite(np.asarray(out)).all()
    (got_loss, got), (want_loss, want) = loss(blockwise)(q, k, v), loss(unpadded)(q, k, v)
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def test_implementation_switch():
    q, k, v, _ = random_qkv(BLOCKWISE_MIN_LENGTH, b=1, h=4)

    def uses_blockwise(t: int, implementation: str | None) -> bool:
        jaxpr = jax.make_jaxpr(
            lambda q, k, v: causal_attention(q, k, v, implementation=implementation)
        )(q[:, :t], k[:, :t], v[:, :t])
        # blockwise.py's custom_vjp is `_attention`; the dense path's is `softmax_attention`
        return "name=_attention" in str(jaxpr)

    assert uses_blockwise(BLOCKWISE_MIN_LENGTH, None)
    assert not uses_blockwise(BLOCKWISE_MIN_LENGTH - 1, None)
    assert uses_blockwise(16, "blockwise")
    assert not uses_blockwise(BLOCKWISE_MIN_LENGTH, "xla")
    with pytest.raises(ValueError, match="attention_implementation"):
        causal_attention(q, k, v, implementation="flash")


def model_loss_and_grads(model: nnx.Module, implementation: str, batch: dict) -> tuple:
    model.attention_implementation = implementation
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        sums = causal_lm_loss_sums(nnx.merge(graphdef, params, rest), batch, None)
        return sums["loss_sum"] / sums["tokens"]

    return jax.jit(jax.value_and_grad(loss))(params)  # compiled whole, not op by op


def assert_blockwise_trains_as_dense(model: nnx.Module, batch: dict) -> None:
    want_loss, want = model_loss_and_grads(model, "xla", batch)
    got_loss, got = model_loss_and_grads(model, "blockwise", batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


def packed_batch(t: int, vocab: int) -> dict:
    rng = np.random.default_rng(1)
    seg = packed_segments(2, t)
    # per-document positions restart at 0, as the packer writes them
    pos = np.zeros_like(seg)
    for r in range(2):
        for i in range(1, t):
            pos[r, i] = pos[r, i - 1] + 1 if seg[r, i] == seg[r, i - 1] else 0
    ids = rng.integers(1, vocab, size=(2, t)).astype(np.int32)
    return dict(input_ids=ids, labels=ids, segment_ids=seg, positions=pos)


MODELS = {
    "llama_window": lambda: LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=8,
        ),
        rngs=nnx.Rngs(0),
    ),  # fmt: skip
    "gemma2": lambda: GemmaForCausalLM(
        GemmaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=8,
        ),
        rngs=nnx.Rngs(0),
    ),  # fmt: skip
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        rngs=nnx.Rngs(0),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(MODELS))
def test_models_pass_blockwise_through(name):
    assert_blockwise_trains_as_dense(MODELS[name](), packed_batch(40, 64))


def test_padded_long_rows_mark_their_padding_and_train_as_with_dense_attention():
    t = BLOCKWISE_MIN_LENGTH  # where the default turns blockwise
    mask = np.array([[1] * n + [0] * (t - n) for n in (100, 700, 0)], np.int32)  # 0: filler
    ids = np.random.default_rng(2).integers(1, 64, size=mask.shape).astype(np.int32) * mask
    batch = dict(input_ids=ids, labels=np.where(mask == 1, ids, IGNORE_INDEX), attention_mask=mask)
    segments = model_segment_ids(batch)
    np.testing.assert_array_equal(segments, mask)  # right-padded: 1 up to the last token
    short = {key: value[:, : t - 1] for key, value in batch.items()}
    assert model_segment_ids(short) is None  # dense attention there: nothing to skip
    # The last quarter of the rows is padding in every row: no block of it is computed.
    block = default_blocks()[0]
    need = needed(np.asarray(segments), t, block)
    assert not need[(700 + block - 1) // block :].any() and need[: 700 // block].any()
    assert_blockwise_trains_as_dense(MODELS["llama_window"](), batch)


def test_padded_preference_pairs_at_a_long_length_score_as_with_dense_attention():
    """The preference losses' padded rows (trainers/sequences.py) take the same marks."""
    t, rng = BLOCKWISE_MIN_LENGTH, np.random.default_rng(3)
    batch = {}
    for side, lengths in (("", (60, 700)), ("rejected_", (90, 300))):
        mask = np.array([[1] * n + [0] * (t - n) for n in lengths], np.int32)
        ids = rng.integers(1, 64, size=mask.shape).astype(np.int32) * mask
        labels = np.where(mask == 1, ids, IGNORE_INDEX)
        labels[:, :20] = IGNORE_INDEX  # the prompt
        batch |= {f"{side}input_ids": ids, f"{side}labels": labels, f"{side}attention_mask": mask}
    marks = _rows(batch, PAIR_SIDES)["model"]["segment_ids"]  # what the model call takes
    masks = np.concatenate([batch["attention_mask"], batch["rejected_attention_mask"]])
    np.testing.assert_array_equal(marks, masks)
    model = MODELS["llama_window"]()
    scores = {}
    for implementation in ("xla", "blockwise"):
        model.attention_implementation = implementation
        scores[implementation] = jax.jit(lambda b: sequence_logps(model, b).logps)(batch)
    np.testing.assert_allclose(scores["blockwise"], scores["xla"], rtol=RTOL)


def test_padded_reward_pairs_at_a_long_length_mark_their_padding_and_score_as_dense():
    """The reward model's padded rows (trainers/reward.py) take the same marks: they once
    reached the backbone without them, and every padding block was computed."""
    t, rng = BLOCKWISE_MIN_LENGTH, np.random.default_rng(4)
    mask = np.array([[1] * n + [0] * (t - n) for n in (60, 700)], np.int32)
    ids = rng.integers(1, 64, size=mask.shape).astype(np.int32) * mask
    reward = RewardModel(MODELS["llama_window"](), seed=0)
    seen = []  # what the backbone's call was given, inside the traced call
    backbone_states = reward.backbone.hidden_states

    def recording(*args, **kwargs):
        seen.append(kwargs.get("segment_ids"))
        return backbone_states(*args, **kwargs)

    reward.backbone.hidden_states = recording

    def scored(ids, mask):
        scores = reward(ids, mask)
        return scores, seen[-1]

    results = {}
    for implementation in ("xla", "blockwise"):
        reward.backbone.attention_implementation = implementation
        results[implementation] = jax.jit(scored)(ids, mask)
    marks = results["blockwise"][1]
    assert marks is not None
    np.testing.assert_array_equal(marks, mask)  # 1 through each row's last real token
    np.testing.assert_allclose(results["blockwise"][0], results["xla"][0], rtol=RTOL)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
)  # fmt: skip
def test_rows_past_the_pretrained_context_warn_once_and_rotate(scaling):
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=64, rope_scaling=scaling,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    ids = jnp.ones((1, 80), jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids)
        logits = model(ids, positions=jnp.arange(30000, 30080)[None])
    assert [str(w.message) for w in caught if "max_position_embeddings" in str(w.message)] == [
        "rows of 80 tokens exceed max_position_embeddings=64: positions past 64 were not seen "
        f"in pretraining (rope_scaling={config.rope_scaling})."
    ]
    assert np.isfinite(np.asarray(logits)).all()
    # The rotary tables at a long position equal the float64 reference of the same scaling.
    inv = rope_inv_freq(8, config.rope_theta, config.rope_scaling)
    pos = np.array([[30000, 65535]], np.int32)
    cos, sin = rope_cos_sin(jnp.asarray(pos), inv, jnp.float32)
    angles = pos[..., None].astype(np.float64) * inv.astype(np.float64)
    angles = np.concatenate([angles, angles], -1)
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-2)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-2)


def buffer_sizes(hlo_text: str) -> list[tuple[int, str]]:
    """(elements, shape) of every array shape that the compiled HLO mentions."""
    sizes = []
    for dims in re.findall(r"(?:f32|bf16|f16|s32|pred|u32|s8|u8)\[([0-9,]*)\]", hlo_text):
        shape = [int(d) for d in dims.split(",") if d]
        sizes.append((int(np.prod(shape)) if shape else 1, dims))
    return sizes


def compiled_step(t: int, vocab: int, implementation: str | None):
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=t,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    model.remat_policy = "nothing_saveable"
    model.attention_implementation = implementation
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = {k: jax.ShapeDtypeStruct((1, t), jnp.int32) for k in
             ("input_ids", "labels", "segment_ids", "positions")}  # fmt: skip

    def train(params, batch):
        def loss(params):
            return causal_lm_loss_sums(nnx.merge(graphdef, params, rest), batch, None)["loss_sum"]

        return jax.grad(loss)(params)

    def evaluate(params, batch):
        return causal_lm_loss_sums(nnx.merge(graphdef, params, rest), batch, None)

    return [jax.jit(f).lower(params, batch).compile().as_text() for f in (train, evaluate)]


def test_no_t_by_t_or_t_by_vocab_buffer_in_a_long_train_step():
    t, vocab = 8192, 16384  # a vocabulary below CHUNKED_LOSS_MIN_VOCAB: chunked for length
    for text in compiled_step(t, vocab, None):
        # T x vocab > T x T here; the largest legitimate buffer is one chunk of logits.
        biggest = max(buffer_sizes(text))
        assert biggest[0] <= CHUNK_LOGITS < t * t // 2, f"a buffer [{biggest[1]}] in the step"
    # The check sees a [T, T] array where one exists: the dense path at 1024 tokens.
    dense = max(buffer_sizes(compiled_step(1024, 64, "xla")[0]))
    assert dense[0] >= 1024 * 1024, dense


def test_cli_model_section_sets_the_attention_implementation():
    from jaxtrain.cli.run_config import parse_overrides, resolve_config, split_config
    from jaxtrain.cli.run_dir import build_model
    from jaxtrain.errors import ArgumentError

    overrides = parse_overrides(
        ["--model.hidden_size", "32", "--model.num_attention_heads", "2",
         "--model.attention_implementation", "blockwise"]
    )  # fmt: skip
    _, section, _, _ = split_config(resolve_config(None, overrides))
    model = build_model({**section, "vocab_size": 64}, None, seed=0)
    assert model.attention_implementation == "blockwise"
    assert "attention_implementation" not in model.config.to_dict()
    with pytest.raises(ArgumentError, match="attention_implementation"):
        build_model({**section, "attention_implementation": "flash"}, None, seed=0)

"""Matmuls in float8 (models/fp8.py, `fp8_matmuls`): the quantizer's scaling, the matmul and
its gradients against float32 within float8's precision (and really quantized), and 50 steps of
a run on the default corpus whose loss stays within 2% of the same run in bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import Trainer, TrainerCallback, TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.data import chunk_dataset, load_default_corpus
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.models.fp8 import FORWARD_DTYPE, GRADIENT_DTYPE, fp8_matmul, quantize
from jaxtrain.models.layers import Projection


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_quantize_puts_the_absolute_maximum_on_the_largest_value():
    x = jnp.asarray([[-3.0, 0.5], [1.5, 0.0]], jnp.float32)
    for dtype in (FORWARD_DTYPE, GRADIENT_DTYPE):
        q, scale = quantize(x, dtype)
        assert q.dtype == dtype
        assert float(jnp.abs(q.astype(jnp.float32)).max()) == float(jnp.finfo(dtype).max)
        np.testing.assert_allclose(q.astype(jnp.float32) * scale, x, rtol=0.13)
    q, scale = quantize(jnp.zeros((2, 2)), FORWARD_DTYPE)  # no division by zero
    assert float(scale) == 1.0 and not jnp.any(q.astype(jnp.float32))


def test_the_matmul_and_its_gradients_are_float32_s_within_float8_precision():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 128)), jnp.bfloat16)
    kernel = jnp.asarray(rng.normal(size=(128, 96)) * 0.05, jnp.bfloat16)
    exact = x.astype(jnp.float32) @ kernel.astype(jnp.float32)
    y = fp8_matmul(x, kernel)
    assert y.dtype == jnp.bfloat16
    # e4m3 keeps 3 mantissa bits: a few percent, and more than bf16's own rounding.
    assert 1e-2 < relative_error(y, exact) < 0.06
    assert relative_error(x @ kernel, exact) < 5e-3

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * exact)

    grads = jax.grad(loss(fp8_matmul), argnums=(0, 1))(x, kernel)
    exact_grads = jax.grad(loss(lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32)),
                           argnums=(0, 1))(x, kernel)  # fmt: skip
    for got, want, like in zip(grads, exact_grads, (x, kernel)):
        assert got.dtype == like.dtype
        assert 1e-2 < relative_error(got, want) < 0.1  # e5m2 gradients: 2 mantissa bits


@pytest.fixture(scope="module")
def corpus():
    corpus = load_default_corpus(vocab_size=512, max_train_bytes=300_000)
    return chunk_dataset(corpus.train, corpus.tokenizer, 64), len(corpus.tokenizer)


class Losses(TrainerCallback):
    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, trainer, logs, step):
        if "loss" in logs:
            self.losses.append(float(logs["loss"]))


def train(corpus, tmp_path, fp8: bool) -> tuple[list[float], Trainer]:
    rows, vocab = corpus
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path / f"fp8-{fp8}"), max_steps=50, total_batch_size=8,
        max_sequence_length=64, learning_rate=3e-3, warmup_steps=5, logging_steps=10,
        dtype="bfloat16", fp8_matmuls=fp8, evaluation_strategy="no", save_final=False,
        progress_bar="none", run_report=False,
    )  # fmt: skip
    losses = Losses()
    trainer = Trainer(arguments=args, model=LlamaForCausalLM(config, rngs=nnx.Rngs(0)),
                      dataset_train=rows, callbacks=[losses])  # fmt: skip
    trainer.train()
    return losses.losses, trainer


def test_fifty_steps_in_fp8_stay_within_two_percent_of_bf16(corpus, tmp_path):
    bf16, _ = train(corpus, tmp_path, fp8=False)
    fp8, trainer = train(corpus, tmp_path, fp8=True)
    assert len(fp8) == len(bf16) == 5
    assert fp8[-1] < 0.9 * fp8[0]  # it learns (the first logged loss is step 10's)
    assert fp8[-1] == pytest.approx(bf16[-1], rel=0.02)
    assert fp8 != bf16  # the matmuls did run in float8
    # The decoder layers' projections in float8, the output head in bf16.
    model = trainer.program.model
    flags = {"/".join(map(str, path)): m.fp8 for path, m in nnx.iter_modules(model)
             if isinstance(m, Projection)}  # fmt: skip
    assert flags and all(on for path, on in flags.items() if not path.endswith("lm_head"))
    assert [on for path, on in flags.items() if path.endswith("lm_head")] == [False]
    # Their float8 products move the logits by float8's error, not bf16's.
    ids = jnp.asarray(np.asarray(corpus[0][:2]["input_ids"]))
    on = model(ids).astype(jnp.float32)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Projection):
            module.fp8 = False
    off = model(ids).astype(jnp.float32)
    assert 5e-3 < relative_error(on, off) < 0.1


def test_fp8_matmuls_is_checked(tmp_path):
    with pytest.raises(ArgumentError, match="fp8_matmuls must be true or false"):
        TrainingArguments(output_dir=str(tmp_path), fp8_matmuls="yes")

"""The fused elementwise kernels (models/elementwise.py, `elementwise_kernels`): each Pallas
kernel, run as its own code in interpret mode on the CPU, equals the XLA reference path, and a
Llama model and a training run with them equal the same without them."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.data import chunk_dataset, load_default_corpus
from jaxtrain.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from jaxtrain.models.elementwise import add_rms_norm, rotary, swiglu

# Widths: not powers of two (masked column blocks), and one past the largest block (4096).
WIDTHS = (72, 4100)


def close(got, want, dtype) -> None:
    """float32: equal to rounding (the kernel sums its squares in another order); bfloat16:
    within its rounding twice (the normalised value, then its product with the weight)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rtol = 2e-6 if dtype == jnp.float32 else 2**-6
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


def kernel_and_reference(fn, *inputs, **kw):
    ours = jax.jit(lambda *a: fn(*a, kernel="interpret", **kw))(*inputs)
    return ours, fn(*inputs, kernel="xla", **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_the_residual_add_and_norm_kernel_equals_the_reference(dtype, width):
    rng = np.random.default_rng(width)
    x, delta = (jnp.asarray(rng.normal(size=(2, 3, width)), dtype) for _ in range(2))
    weight = jnp.asarray(rng.normal(size=(width,)), jnp.float32)
    (total, normed), (want_total, want_normed) = kernel_and_reference(
        add_rms_norm, x, delta, weight, eps=1e-6, dtype=dtype
    )
    assert total.dtype == want_total.dtype == dtype and normed.dtype == dtype
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(want_total, np.float32))
    close(normed, want_normed, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_swiglu_and_rotary_kernels_equal_the_reference(dtype):
    rng = np.random.default_rng(1)
    gate, up = (jnp.asarray(rng.normal(size=(2, 3, 4100)), dtype) for _ in range(2))
    got, want = kernel_and_reference(swiglu, gate, up)
    assert got.dtype == dtype
    close(got, want, dtype)
    # Rotary: heads of 80 (halves of 40, not a power of two), cos/sin shared by the batch.
    q = jnp.asarray(rng.normal(size=(2, 5, 3, 80)), dtype)
    angles = rng.normal(size=(1, 5, 40)) * 3
    cos, sin = (jnp.asarray(np.concatenate([f(angles)] * 2, -1), dtype) for f in (np.cos, np.sin))
    got, want = kernel_and_reference(rotary, q, cos, sin)
    assert got.shape == q.shape and got.dtype == dtype
    close(got, want, dtype)


def test_the_kernels_gradients_are_the_reference_s():
    rng = np.random.default_rng(2)
    x, delta = (jnp.asarray(rng.normal(size=(4, 96)), jnp.float32) for _ in range(2))
    weight = jnp.asarray(rng.normal(size=(96,)), jnp.float32)

    def loss(kernel):
        def value(x, delta, weight):
            total, normed = add_rms_norm(x, delta, weight, eps=1e-6, dtype=jnp.float32,
                                         kernel=kernel)  # fmt: skip
            gated = swiglu(normed, total, kernel=kernel)
            return jnp.sum(gated * jnp.arange(96.0)) + jnp.sum(total**2)

        return jax.jit(jax.grad(value, argnums=(0, 1, 2)))

    for got, want in zip(loss("interpret")(x, delta, weight), loss("xla")(x, delta, weight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


CONFIG = dict(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def set_kernels(model: nnx.Module, kernels: str) -> int:
    modules = [m for _, m in nnx.iter_modules(model) if hasattr(m, "elementwise_kernels")]
    for module in modules:
        module.elementwise_kernels = kernels
    return len(modules)


@pytest.mark.parametrize("scan", [False, True])
def test_a_llama_model_with_the_kernels_equals_the_model_without(scan):
    model = LlamaForCausalLM(LlamaConfig(**CONFIG), rngs=nnx.Rngs(0))
    model.scan_layers = scan
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 24)), jnp.int32)

    def loss_and_grads(kernels: str):
        # Each layer's norm-and-add, MLP gate and attention's rotary: 3 modules a layer.
        assert set_kernels(model, kernels) == 3 * CONFIG["num_hidden_layers"]
        graphdef, params = nnx.split(model)
        # The kernels are what runs: add-and-norm, gate, and rotary of q and k (a layer's
        # four, once under scan).
        forward = str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(ids))(params))
        assert forward.count("pallas_call") == (0 if kernels == "xla" else 4 * (1 if scan else 2))

        def loss(params):
            logits = nnx.merge(graphdef, params)(ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss, logits), grads = loss_and_grads("interpret")
    (want_loss, want_logits), want_grads = loss_and_grads("xla")
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def rows():
    corpus = load_default_corpus(vocab_size=512, max_train_bytes=300_000)  # test_fp8.py's
    return chunk_dataset(corpus.train, corpus.tokenizer, 32), len(corpus.tokenizer)


def run(rows, tmp_path, kernels: str) -> tuple[list[float], nnx.Module]:
    data, vocab = rows
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "vocab_size": vocab}), rngs=nnx.Rngs(0))
    args = TrainingArguments(
        output_dir=str(tmp_path / kernels), max_steps=3, total_batch_size=4,
        max_sequence_length=32, learning_rate=3e-3, warmup_steps=0, logging_steps=1,
        elementwise_kernels=kernels, report_to=[],
    )  # fmt: skip
    Trainer(arguments=args, model=model, dataset_train=data).train()
    lines = (tmp_path / kernels / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    return [row["loss"] for row in logged if "loss" in row], model


def test_a_run_with_the_kernels_trains_as_the_run_without(rows, tmp_path):
    losses, model = run(rows, tmp_path, "interpret")
    want, _ = run(rows, tmp_path, "xla")
    assert len(losses) == 3
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    # The run set the choice on every layer's modules.
    kinds = {m.elementwise_kernels for _, m in nnx.iter_modules(model)
             if hasattr(m, "elementwise_kernels")}  # fmt: skip
    assert kinds == {"interpret"}


def test_kernels_that_cannot_run_are_refused_with_the_field(rows, tmp_path):
    data, vocab = rows
    with pytest.raises(ArgumentError, match="elementwise_kernels='triton'.*xla, pallas, interpret"):
        TrainingArguments(output_dir=str(tmp_path / "a"), elementwise_kernels="triton")
    llama = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "vocab_size": vocab}), rngs=nnx.Rngs(0))
    args = TrainingArguments(output_dir=str(tmp_path / "b"), max_steps=1,
                             elementwise_kernels="pallas")  # fmt: skip
    with pytest.raises(ArgumentError, match="'pallas' runs Triton kernels on NVIDIA GPUs.*cpu"):
        Trainer(arguments=args, model=llama, dataset_train=data).train()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2),
                           rngs=nnx.Rngs(0))  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / "c"), max_steps=1,
                             elementwise_kernels="interpret")  # fmt: skip
    with pytest.raises(ArgumentError, match="GPT2LMHeadModel has no layers that take fused"):
        Trainer(arguments=args, model=gpt2, dataset_train=data).train()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernels_lower_to_triton_modules_a_gpu_accepts(dtype, verified_triton):
    """Lowered for CUDA from this CPU and verified as XLA:GPU verifies them: the SwiGLU
    kernel's bf16 division (silu's) once reached the GPU, where Triton refused it."""
    from jaxtrain.models import elementwise

    rows = jax.ShapeDtypeStruct((2, 3, 4100), dtype)
    weight = jax.ShapeDtypeStruct((4100,), jnp.float32)
    heads = jax.ShapeDtypeStruct((2, 5, 3, 80), dtype)
    angles = jax.ShapeDtypeStruct((2, 5, 80), dtype)
    kernels = [
        (functools.partial(elementwise._add_rms_norm_rows, eps=1e-6, dtype=dtype),
         (rows, rows, weight)),
        (elementwise._swiglu_rows, (rows, rows)),
        (elementwise._rotary_rows, (heads, angles, angles)),
    ]  # fmt: skip
    for kernel, inputs in kernels:
        lowered = jax.jit(functools.partial(kernel, interpret=False)).trace(*inputs)
        assert "__gpu$xla.gpu.triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert len(verified_triton) == 3, verified_triton

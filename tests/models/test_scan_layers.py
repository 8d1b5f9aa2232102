"""Decoder layers under jax.lax.scan (models/layer_scan.py) equal the loop over them.

Each comparison compiles both programs for real (float32 on the CPU), for every decoder
family, with and without remat, with LoRA (dropout on), with a QLoRA base and with packed
rows: the logits agree to 1e-6 of their largest value, the gradients to 1e-6 of their norm
and each parameter's to 1e-5 of its largest value (or 1e-6 of the largest gradient, for
parameters whose gradient is nearly 0). The programs are not bit-equal: XLA fuses a loop
body differently from the unrolled layers, so float32 rounds differently. Two loops that
differ only in an everything_saveable remat are 2.5e-6 apart on Gemma 3's q_norm gradient
(relative to its largest value); a layer computed wrongly is off by O(1).
"""

from __future__ import annotations

import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.config.sections import ModelSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.models import LlamaConfig, LlamaForCausalLM, MoeConfig, MoeForCausalLM
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel
from jaxtrain.models.layer_scan import layer_period
from jaxtrain.models.llama import DecoderLayer
from jaxtrain.models.lora import apply_lora, set_lora_dropout_key
from jaxtrain.quantization import QuantizedKernel

LLAMA = dict(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02,
)  # fmt: skip


def llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}), rngs=nnx.Rngs(0))


def gemma2() -> GemmaForCausalLM:
    config = GemmaConfig(
        **LLAMA, sliding_window=5, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
        query_pre_attn_scalar=8.0,
    )  # fmt: skip
    return GemmaForCausalLM(config, rngs=nnx.Rngs(0))


def gemma3(layer_types: list[str] | None = None) -> GemmaForCausalLM:
    """Gemma 3's sliding/full pattern at a small period: 3 (two sliding, one full) over 7
    layers, so the scan runs 2 groups and the 7th layer after them."""
    s, f = "sliding_attention", "full_attention"
    layer_types = layer_types or [s, s, f, s, s, f, s]
    config = GemmaConfig(
        **{**LLAMA, "num_hidden_layers": len(layer_types)}, model_type="gemma3_text",
        sliding_window=5, qk_norm=True, rope_local_base_freq=1000.0, layer_types=layer_types,
        query_pre_attn_scalar=8.0,
    )  # fmt: skip
    return GemmaForCausalLM(config, rngs=nnx.Rngs(0))


def mixtral() -> MoeForCausalLM:
    config = MoeConfig(
        **{**LLAMA, "num_hidden_layers": 3}, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
    )  # fmt: skip
    return MoeForCausalLM(config, rngs=nnx.Rngs(0))


def qwen2_moe() -> MoeForCausalLM:
    """Dense and sparse layers alternating (decoder_sparse_step=2), a shared expert."""
    config = MoeConfig(
        **LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=2, router_aux_loss_coef=0.05,
        router_z_loss_coef=0.01, model_type="qwen2_moe",
    )  # fmt: skip
    return MoeForCausalLM(config, rngs=nnx.Rngs(0))


def gpt2() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=61, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, initializer_range=0.2,
    )  # fmt: skip
    return GPT2LMHeadModel(config, rngs=nnx.Rngs(0))


FAMILIES = {
    "llama": llama,
    "mistral": lambda: llama(model_type="mistral", sliding_window=5),
    "qwen2": lambda: llama(model_type="qwen2", attention_bias=True),
    "qwen3": lambda: llama(model_type="qwen3", qk_norm=True),
    "gemma2": gemma2,
    "gemma3": gemma3,
    "mixtral": mixtral,
    "qwen2_moe": qwen2_moe,
    "gpt2": gpt2,
}


def layers_of(model: nnx.Module):
    return model.transformer.h if isinstance(model, GPT2LMHeadModel) else model.model.layers


def ids(shape=(2, 12), vocab: int = 61) -> jax.Array:
    return jnp.asarray(np.random.RandomState(0).randint(0, vocab, size=shape))


def logits_and_grads(model: nnx.Module, scan: bool, remat: str = "none", key=None, **call):
    """(logits, aux losses or None, d loss / d every nnx.Param) of one compiled forward and
    backward; the other variables (a frozen or quantized base) are arguments, not Params."""
    model.scan_layers = scan
    if remat != "none":
        model.remat_policy = remat
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    returns_aux = getattr(model, "returns_aux_losses", False)

    def loss(params, rest, tokens):
        m = nnx.merge(graphdef, params, rest)
        if key is not None:
            set_lora_dropout_key(m, key)
        out = m(tokens, return_aux=True, **call) if returns_aux else (m(tokens, **call), None)
        logits, aux = out
        total = jnp.sum(jnp.sin(logits)) + (0.0 if aux is None else 10 * aux["aux_loss"])
        return total, (logits, aux)

    grad = jax.jit(jax.grad(loss, has_aux=True))
    grads, (logits, aux) = grad(params, rest, ids())
    return logits, aux, grads


def assert_close(got, want, rtol: float, what: str) -> None:
    """max |got - want| <= rtol * max |want| (relative to the array's scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
    assert error <= rtol * scale, f"{what}: {error:.3g} > {rtol} * {scale:.3g}"


def assert_scan_equals_loop(model: nnx.Module, remat: str = "none", **kw) -> None:
    loop = logits_and_grads(model, False, remat, **kw)
    scanned = logits_and_grads(model, True, remat, **kw)
    assert_close(scanned[0], loop[0], 1e-6, "logits")
    if loop[1] is not None:
        for name in loop[1]:
            assert_close(scanned[1][name], loop[1][name], 1e-6, name)
    flat_loop = nnx.to_flat_state(loop[2])
    flat_scan = dict(nnx.to_flat_state(scanned[2]))
    assert len(flat_loop) == len(flat_scan) > 0
    pairs = [
        (path, np.asarray(flat_scan[path][...], np.float64), np.asarray(g[...], np.float64))
        for path, g in flat_loop
    ]
    largest = max(np.max(np.abs(want)) for _, _, want in pairs)
    for path, got, want in pairs:
        error, scale = np.max(np.abs(got - want)), np.max(np.abs(want))
        assert error <= max(1e-5 * scale, 1e-6 * largest), (path, error, scale, largest)
    error = np.sqrt(sum(np.sum((got - want) ** 2) for _, got, want in pairs))
    norm = np.sqrt(sum(np.sum(want**2) for _, _, want in pairs))
    assert error <= 1e-6 * norm, (error, norm)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_scanned_equals_the_loop_in_every_family(family):
    model = FAMILIES[family]()
    assert layer_period(layers_of(model)) is not None  # this model does scan
    assert_scan_equals_loop(model)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2_moe"])
@pytest.mark.parametrize("remat", ["nothing_saveable", "dots_saveable"])
def test_scanned_equals_the_loop_under_remat(family, remat):
    assert_scan_equals_loop(FAMILIES[family](), remat)


def test_the_periods_found():
    """One scan step per layer of a uniform stack; Gemma 2's sliding/full pair; Gemma 3's
    pattern; a MoE model's dense/sparse pair; none for a pattern that does not repeat."""
    assert layer_period(layers_of(llama())) == 1
    assert layer_period(layers_of(gemma2())) == 2
    assert layer_period(layers_of(gemma3())) == 3
    assert layer_period(layers_of(mixtral())) == 1
    assert layer_period(layers_of(qwen2_moe())) == 2
    s, f = "sliding_attention", "full_attention"
    assert layer_period(layers_of(gemma3([s, f, f, s, s]))) is None
    assert layer_period(layers_of(llama(num_hidden_layers=1))) is None


def test_layers_that_repeat_no_pattern_run_as_the_loop():
    """LoRA on one layer only, and Gemma layers in no repeating order: each layer runs on
    its own (never a different computation), and the result is the loop's."""
    model = llama()
    apply_lora(model.model.layers[1], rank=2, alpha=4.0)
    assert layer_period(model.model.layers) is None
    assert_scan_equals_loop(model)
    s, f = "sliding_attention", "full_attention"
    assert_scan_equals_loop(gemma3([s, f, f, s, s]))


@pytest.mark.parametrize(
    "family, remat",  # GPT-2 has no remat policy
    [(f, r) for f in ("llama", "gemma2") for r in ("none", "nothing_saveable")]
    + [("gpt2", "none")],
)
def test_lora_with_dropout_scans_like_the_loop(family, remat):
    """Adapters (B made nonzero, as after some training) on every projection, dropout on:
    each layer's dropout key (a traced attribute) is scanned along with its state, so the
    masks are the loop's (another key moves the logits by O(1))."""
    model = apply_lora(FAMILIES[family](), rank=4, alpha=8.0, dropout=0.25)
    rng = np.random.default_rng(0)
    for _, module in nnx.iter_modules(model):
        if hasattr(module, "b") and isinstance(module.b, nnx.Param):
            module.b.set_value(jnp.asarray(0.02 * rng.standard_normal(module.b.shape), "float32"))
    assert_scan_equals_loop(model, remat, key=jax.random.key(7))


def qlora_llama(**overrides) -> LlamaForCausalLM:
    from jaxtrain.quantization import quantize_base

    model = llama(hidden_size=64, intermediate_size=128, **overrides)
    apply_lora(model, rank=4, alpha=8.0)
    return quantize_base(model, "nf4", 64)


@pytest.mark.parametrize("remat", ["none", "nothing_saveable"])
def test_a_quantized_base_scans_like_the_loop(remat):
    assert_scan_equals_loop(qlora_llama(), remat)


def _scan_operands(jaxpr) -> list:
    """The operand avals of every scan in a (closed) jaxpr, nested calls included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.extend(v.aval for v in eqn.invars)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_scan_operands(sub))
    return found


def test_a_quantized_base_is_dequantized_one_layer_at_a_time():
    """The scan reads each layer's codes where they are (no stacked copy of the base) and
    never stacks the float kernels: each layer's kernels are dequantized inside its step."""
    model = qlora_llama()
    model.scan_layers = True
    kernels = [m for _, m in nnx.iter_modules(model.model.layers[0])
               if isinstance(m, QuantizedKernel)]  # fmt: skip
    assert kernels
    n = model.config.num_hidden_layers
    jaxpr = jax.make_jaxpr(lambda m, x: m(x))(model, ids()).jaxpr
    operands = [(a.shape, jnp.dtype(a.dtype)) for a in _scan_operands(jaxpr)]
    codes = (kernels[0].codes.shape, jnp.dtype(jnp.uint8))
    assert operands.count(codes) == n * sum(k.codes.shape == codes[0] for k in kernels)
    assert not [o for o in operands if o[1] == jnp.uint8 and o[0][:1] == (n,)]
    stacked = {shape for shape, _ in operands if shape[:1] == (n,)}
    for kernel in kernels:
        assert (n, *kernel.scales.shape) in stacked  # the float scales are scanned
        assert (n, *kernel.shape) not in stacked, kernel.shape


def test_packed_rows_scan_like_the_loop():
    """Two documents a row (segment ids, positions restarting at each)."""
    segment_ids = jnp.asarray([[1] * 5 + [2] * 7, [1] * 8 + [2] * 4])
    positions = jnp.asarray([list(range(5)) + list(range(7)), list(range(8)) + list(range(4))])
    for family in ("llama", "gemma3", "mixtral", "gpt2"):
        assert_scan_equals_loop(FAMILIES[family](), segment_ids=segment_ids, positions=positions)


def test_the_scanned_forward_traces_the_layer_once(monkeypatch):
    """What makes compile time independent of depth: a 6-layer model's layer body is traced
    once under scan, six times in the loop (and the jaxpr holds one layer's matmuls)."""
    calls = []
    original = DecoderLayer.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "__call__", counted)
    model = llama(num_hidden_layers=6)
    dots = {}
    for scan in (False, True):
        calls.clear()
        model.scan_layers = scan
        jaxpr = jax.make_jaxpr(lambda m, x: m(x))(model, ids())
        dots[scan] = str(jaxpr).count("dot_general")
        assert len(calls) == (1 if scan else 6)
    # Per layer: q/k/v, scores, values, o, gate/up, down; one more for the head.
    assert dots[False] == 6 * (dots[True] - 1) + 1


def _losses(out) -> list[float]:
    lines = (out / "run" / "metrics.jsonl").open()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_qlora_trains_the_same_with_and_without_scan(tmp_path):
    """The Trainer on a tiny config, LoRA (dropout on) over an NF4 base: the same loss at
    each of 3 steps. Left unset, scan_layers is on for the quantized base."""
    rows = [{"input_ids": (np.arange(16) * (i + 1)) % 61} for i in range(24)]
    losses = {}
    for scan, given in ((False, False), (True, None)):
        args = TrainingArguments(
            output_dir=str(tmp_path / str(scan) / "run"), max_steps=3, total_batch_size=4,
            max_sequence_length=16, learning_rate=5e-2, warmup_steps=0, logging_steps=1,
            progress_bar="none", save_final=False, run_report=False, lora_rank=4,
            lora_alpha=8.0, lora_dropout=0.1, quantization="nf4", scan_layers=given,
        )  # fmt: skip
        model = llama(hidden_size=64, intermediate_size=128, num_hidden_layers=3)
        trainer = Trainer(arguments=args, model=model, dataset_train=rows)
        assert all(m.scan_layers is scan for _, m in nnx.iter_modules(trainer.model)
                   if hasattr(m, "scan_layers"))  # fmt: skip
        trainer.train()
        losses[scan] = _losses(tmp_path / str(scan))
    assert len(losses[True]) == 3
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


def test_scan_layers_is_validated_and_unset_on_for_a_quantized_base_only():
    with pytest.raises(ArgumentError, match="scan_layers must be true, false or None"):
        TrainingArguments(scan_layers="yes")
    scans = {
        (given, quantization): ModelSettings.from_arguments(
            TrainingArguments(scan_layers=given, quantization=quantization, lora_rank=4)
        ).scan_layers
        for given in (None, False, True)
        for quantization in (None, "nf4")
    }
    assert scans == {(None, None): False, (None, "nf4"): True, (False, None): False,
                     (False, "nf4"): False, (True, None): True, (True, "nf4"): True}  # fmt: skip

"""QLoRA: a LoRA model on a quantized frozen base. Its forward and adapter gradients equal LoRA
on the dequantized float base; SFT, DPO and GRPO learn on it; a run resumes exactly; its PEFT
adapters load onto the dequantized base with equal logits; bad settings name the fix."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_fixtures import StepMetrics, addition_pairs, tiny_arguments, tiny_model

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.config.sections import ModelSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.models import MoeConfig, MoeForCausalLM
from jaxtrain.models.moe import SparseMoeBlock
from jaxtrain.quantization import QuantizedKernel, dequantize_base, quantized_bytes
from jaxtrain.training.program import ModelParts

VOCAB = 64


def rows(n: int = 64, length: int = 16) -> list[dict]:
    rng = np.random.default_rng(0)
    base = rng.integers(5, VOCAB, size=8)
    return [{"input_ids": np.roll(base, i).repeat(2)[:length]} for i in range(n)]


def qlora_model(kind: str = "nf4", seed: int = 0):
    """A tiny Llama (hidden 64: the 64-row blocks divide it) with LoRA on a quantized base."""
    args = TrainingArguments(lora_rank=4, lora_alpha=8, quantization=kind, seed=3)
    model = tiny_model(seed, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    return ModelParts.adopt(model, ModelSettings.from_arguments(args)).model


def randomized_adapters(model) -> None:
    """B starts at 0 (an adapter adds nothing): give it values so the adapters matter."""
    for i, (path, variable) in enumerate(nnx.iter_graph(model)):
        if isinstance(variable, nnx.Param) and path[-1] == "b":
            variable[...] = jax.random.normal(jax.random.key(i), variable[...].shape) * 0.2


def test_the_base_is_quantized_and_small():
    model = qlora_model()
    kernels = [m for _, m in nnx.iter_modules(model) if isinstance(m, QuantizedKernel)]
    # qkv, o, gate_up and down of every layer; the lm_head stays float
    assert len(kernels) == 4 * model.config.num_hidden_layers
    stored, bf16 = quantized_bytes(model)
    assert stored / bf16 <= 0.30  # NF4: half a byte a weight plus a float32 scale per 64
    stored8, bf16_8 = quantized_bytes(qlora_model("int8"))
    assert stored8 / bf16_8 <= 0.53
    params = nnx.state(model, nnx.Param)
    assert all("lora" in str(p) for p, _ in nnx.to_flat_state(params))  # only adapters train


@pytest.mark.parametrize("factory", [False, True])
def test_param_dtype_stores_the_frozen_base_but_not_its_codes_and_scales(factory, tmp_path):
    """The embedding and lm_head of a QLoRA model are frozen floats: bfloat16 under
    param_dtype bfloat16 (an 8B base's 2 GB each in float32), the nf4 codes and float32
    block scales as quantized; a ModelFactory's model is created the same way."""
    from jaxtrain.parallel import ModelFactory

    args = tiny_arguments(
        TrainingArguments, tmp_path, lora_rank=4, lora_alpha=8, quantization="nf4",
        param_dtype="bfloat16", dtype="bfloat16", max_steps=1,
    )  # fmt: skip
    build = lambda: tiny_model(0, hidden_size=64, intermediate_size=128, num_attention_heads=4)  # noqa: E731
    trainer = Trainer(arguments=args, model=ModelFactory(build) if factory else build(),
                      dataset_train=rows())  # fmt: skip
    trainer.program.create_state()
    dtypes = {
        ".".join(map(str, path[-2:])): jnp.dtype(v.dtype).name
        for path, v in nnx.to_flat_state(trainer.program.frozen_state())
    }
    assert dtypes["embed_tokens.embedding"] == "bfloat16"
    assert dtypes["lm_head.kernel"] == "bfloat16"
    quantized = {k: d for k, d in dtypes.items() if k.split(".")[-1] in ("codes", "scales")}
    assert quantized and set(quantized.values()) == {"uint8", "float32"}, quantized
    # The step dequantizes each kernel straight to the compute dtype (no float32 copy).
    kernels = [m for _, m in nnx.iter_modules(trainer.program.parts.model)
               if isinstance(m, QuantizedKernel)]  # fmt: skip
    assert kernels and {jnp.dtype(k.dtype) for k in kernels} == {jnp.dtype("bfloat16")}
    if not factory:
        kernel = kernels[0]
        assert kernel[...].dtype == jnp.bfloat16 and kernel.dequantized.dtype == jnp.float32


def test_forward_and_adapter_gradients_equal_lora_on_the_dequantized_base():
    assert_equals_lora_on_the_dequantized_base(qlora_model())


def test_a_moe_base_stores_its_experts_quantized_too():
    """The experts are most of a MoE model's weights (they were once left in float): they are
    quantized like the projections, and the model still equals LoRA on its dequantized base."""
    config = MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    args = TrainingArguments(lora_rank=4, lora_alpha=8, quantization="nf4", seed=3)
    model = MoeForCausalLM(config, rngs=nnx.Rngs(0))
    model = ModelParts.adopt(model, ModelSettings.from_arguments(args)).model
    blocks = [m for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2
    for block in blocks:
        assert isinstance(block.gate_up, QuantizedKernel), block.gate_up
        assert isinstance(block.down, QuantizedKernel), block.down
    stored, bf16 = quantized_bytes(model)
    assert stored / bf16 <= 0.30
    assert_equals_lora_on_the_dequantized_base(model)


def assert_equals_lora_on_the_dequantized_base(quantized) -> None:
    randomized_adapters(quantized)
    float_base = dequantize_base(nnx.clone(quantized))  # the same numbers, stored in float
    assert not [m for _, m in nnx.iter_modules(float_base) if isinstance(m, QuantizedKernel)]
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 12)))

    def loss(params, graphdef, rest):
        logits = nnx.merge(graphdef, params, rest)(ids)
        return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 7]), logits

    results = []
    for model in (quantized, float_base):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        results.append(jax.value_and_grad(loss, has_aux=True)(params, graphdef, rest))
    (_, q_logits), q_grads = results[0]
    (_, f_logits), f_grads = results[1]
    np.testing.assert_allclose(np.asarray(q_logits), np.asarray(f_logits), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(q_grads), jax.tree.leaves(f_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_bad_quantization_settings_say_the_fix():
    with pytest.raises(ArgumentError, match="set --lora_rank"):
        TrainingArguments(quantization="nf4")
    with pytest.raises(ArgumentError, match="quantization='nf8'"):
        TrainingArguments(quantization="nf8", lora_rank=4)
    with pytest.raises(ArgumentError, match="even integer"):
        TrainingArguments(quantization="nf4", lora_rank=4, quantization_block_size=5)
    args = TrainingArguments(lora_rank=4, quantization="nf4", quantization_block_size=48)
    with pytest.raises(
        ArgumentError,
        match=r"block 48 does not divide the \d+ input rows of model/layers/0/.*/kernel",
    ):
        ModelParts.adopt(
            tiny_model(hidden_size=64, intermediate_size=128, num_attention_heads=4),
            ModelSettings.from_arguments(args),
        )


def qlora_run(tmp_path, steps: int, stop_after: int | None = None, **overrides):
    class Stop:
        def on_step_end(self, trainer, state, metrics, step):
            if step == stop_after:
                trainer.should_stop = True

    args = tiny_arguments(
        TrainingArguments, tmp_path, max_steps=steps, lora_rank=4, lora_alpha=8,
        quantization="nf4", save_steps=2, learning_rate=5e-2, **overrides,
    )  # fmt: skip
    model = tiny_model(0, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    trainer = Trainer(arguments=args, model=model, dataset_train=rows(), callbacks=[Stop()])
    return trainer, trainer.train()


def test_an_nf4_sft_run_learns_and_resumes_exactly(tmp_path):
    whole, out = qlora_run(tmp_path / "a", steps=8)
    losses = [r["loss"] for r in _logs(tmp_path / "a")]
    assert losses[-1] < 0.92 * losses[0]  # 4.08 -> 3.58 in 8 steps
    qlora_run(tmp_path / "b", steps=8, stop_after=4)  # killed after its step-4 save
    _, resumed = qlora_run(tmp_path / "b", steps=8)
    for a, b in zip(jax.tree.leaves(out.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _logs(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").open() if '"loss"' in line]


def test_peft_loads_the_adapters_onto_the_dequantized_base(tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    from jaxtrain.hf import save_pretrained
    from jaxtrain.models.frozen import unfreeze

    trainer, out = qlora_run(tmp_path, steps=3)
    adapted = trainer.model_from_state(out.state)
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, 10))
    want = np.asarray(adapted(jnp.asarray(ids)))
    base = dequantize_base(nnx.clone(adapted))
    for _, module in nnx.iter_modules(base):  # the base alone: no adapters
        if getattr(module, "lora", None) is not None:
            module.lora = None
    save_pretrained(unfreeze(base), tmp_path / "base")  # its weights as plain parameters
    trainer.save_pretrained(out.state, tmp_path / "adapter", lora_format="peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    import torch

    with torch.no_grad():
        got = loaded(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_dpo_on_an_nf4_base_learns_with_the_base_as_its_reference(tokenizer, tmp_path):
    from jaxtrain.trainers import DPOArguments, DPOTrainer

    args = tiny_arguments(
        DPOArguments, tmp_path, max_steps=10, lora_rank=4, lora_alpha=8, quantization="nf4",
        learning_rate=5e-2, beta=0.1,
    )  # fmt: skip
    trainer = DPOTrainer(
        arguments=args,
        model=tiny_model(0, hidden_size=64, intermediate_size=128, num_attention_heads=4),
        dataset_train=addition_pairs(),
        processing_class=tokenizer,
    )
    assert trainer.model.reference is None  # no second copy of the base
    trainer.train()
    logs = _logs(tmp_path)
    assert logs[-1]["loss"] < logs[0]["loss"] and logs[-1]["rewards/margins"] > 0


def test_grpo_on_an_nf4_base_raises_its_reward(tokenizer, tmp_path):
    from test_grpo import big_first_number, grpo_args, prompts

    from jaxtrain.trainers import GRPOTrainer

    # A large alpha / rank: B starts at 0, and a tiny model's adapters move slowly otherwise.
    args = grpo_args(
        tmp_path, max_steps=40, learning_rate=3e-2, beta=0.04, seed=0, lora_rank=8,
        lora_alpha=128, quantization="nf4", logging_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        arguments=args,
        model=tiny_model(0, hidden_size=64, intermediate_size=128, num_attention_heads=4),
        reward_funcs=[big_first_number],
        dataset_train=prompts(),
        processing_class=tokenizer,
    )
    assert trainer.model.reference is None  # the KL reference is the base without adapters
    trainer.train()
    rewards = [r["reward"] for r in _logs(tmp_path)]
    first, last = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert last > first + 0.05, (first, last, rewards)


@pytest.mark.parametrize("quantization", [None, "nf4"])
def test_lora_with_remat_trains_like_without(tmp_path, quantization):
    """Rematerialised layers with a frozen (or quantized) base: nnx.remat under jax.grad
    refused to write the frozen variables back (TraceContextError); the layers' state is now
    an explicit argument of jax.checkpoint. The losses equal the run without remat."""
    losses = {}
    for remat in ("none", "nothing_saveable"):
        out = tmp_path / remat
        args = tiny_arguments(
            TrainingArguments, out, max_steps=3, lora_rank=4, lora_dropout=0.1,
            quantization=quantization, gradient_checkpointing=remat, learning_rate=5e-2,
        )  # fmt: skip
        model = tiny_model(0, hidden_size=64, intermediate_size=128, num_attention_heads=4)
        Trainer(arguments=args, model=model, dataset_train=rows()).train()
        losses[remat] = [r["loss"] for r in _logs(out)]
    np.testing.assert_allclose(losses["nothing_saveable"], losses["none"], rtol=1e-5)


def _base_model(seed: int = 0):
    return tiny_model(seed, hidden_size=64, intermediate_size=128, num_attention_heads=4)


@pytest.mark.parametrize("task", ["kto", "orpo", "cpo", "reward", "distill"])
def test_every_other_task_trains_on_an_nf4_base(tokenizer, tmp_path, task):
    """Each task trainer takes QLoRA as SFT, DPO and GRPO do (tested above): its policy's base
    is stored quantized, only the adapters (and a reward model's score head) train, and its
    loss falls. Distillation quantizes the student; its teacher stays a float model."""
    from jaxtrain import trainers

    classes = {
        "kto": (trainers.KTOTrainer, trainers.KTOArguments),
        "orpo": (trainers.ORPOTrainer, trainers.ORPOArguments),
        "cpo": (trainers.CPOTrainer, trainers.CPOArguments),
        "reward": (trainers.RewardTrainer, TrainingArguments),
        "distill": (trainers.DistillationTrainer, trainers.DistillationArguments),
    }
    trainer_class, arguments_class = classes[task]
    args = tiny_arguments(
        arguments_class, tmp_path, max_steps=8, lora_rank=8, lora_alpha=32, quantization="nf4",
        learning_rate=5e-2,
    )  # fmt: skip
    extra = {}
    rows = addition_pairs(32)
    if task == "distill":
        extra["teacher_model"] = _base_model(seed=1)
        rows = [{"text": f"{r['prompt']} {r['chosen']}"} for r in rows]
    seen = StepMetrics()
    trainer = trainer_class(
        arguments=args, model=_base_model(), dataset_train=rows, processing_class=tokenizer,
        callbacks=[seen], **extra,
    )  # fmt: skip
    policy = trainer.program.parts.model
    policy = getattr(policy, "model", policy)  # a task model's policy (the teacher is apart)
    assert [m for _, m in nnx.iter_modules(policy) if isinstance(m, QuantizedKernel)]
    trainer.train()
    trained = [str(path) for path, _ in nnx.to_flat_state(trainer.program.abstract_state().params)]
    assert all("lora" in p or "score" in p for p in trained), trained
    losses = [s["loss_sum"] / max(s["tokens"], 1.0) for s in seen.steps]
    assert losses[-1] < losses[0], losses

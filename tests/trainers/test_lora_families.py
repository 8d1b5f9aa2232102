"""LoRA beyond the Llama family: a ViT image classifier trains adapters on its attention and
MLP projections with its classifier head trainable, and a lora_targets name that matches
nothing of the model stops the CLI with exit 2 and a message, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from test_image_classification import CLASSES, SIZE, draw_shapes

from jaxtrain import TrainingArguments
from jaxtrain.models.frozen import Frozen
from jaxtrain.models.lora import merge_lora
from jaxtrain.models.vit import ViTConfig, ViTForImageClassification
from jaxtrain.trainers.classification import ImageClassificationTrainer


def flat(state) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(state)}


def test_vit_classifier_trains_lora_adapters_and_its_head(tmp_path):
    config = ViTConfig(image_size=SIZE, patch_size=4, num_channels=1, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                       num_labels=CLASSES)  # fmt: skip
    model = ViTForImageClassification(config, rngs=nnx.Rngs(0))
    base = flat(nnx.state(model, nnx.Param))
    args = TrainingArguments(
        output_dir=str(tmp_path), learning_rate=1e-2, warmup_steps=0, max_steps=6,
        total_batch_size=16, logging_steps=3, progress_bar="none", seed=0,
        max_sequence_length=8, lora_rank=4, lora_alpha=8.0, lora_targets=["attention", "mlp"],
    )  # fmt: skip
    trainer = ImageClassificationTrainer(
        arguments=args, model=model, dataset_train=draw_shapes(96, seed=0)
    )
    out = trainer.train()
    params = flat(out.state.params)
    adapters = {k for k in params if "/lora/" in k}
    projections = {k.split("/lora/")[0].split("/")[-1] for k in adapters}
    assert projections == {"qkv", "out", "fc1", "fc2"}
    assert len(adapters) == 2 * 4 * config.num_hidden_layers  # A and B of each
    assert set(params) - adapters == {"classifier/kernel", "classifier/bias"}
    assert not np.array_equal(params["classifier/kernel"], base["classifier/kernel"])
    assert trainer.num_parameters == sum(v.size for v in params.values())
    frozen = {k: v for k, v in flat(trainer.program.rest).items() if k in base}
    assert set(frozen) == set(base) - {"classifier/kernel", "classifier/bias"}
    for key, value in frozen.items():  # the base stays bit for bit
        assert np.array_equal(value, base[key]), key
    assert all(
        isinstance(v, Frozen)
        for p, v in nnx.to_flat_state(trainer.program.rest)
        if "/".join(map(str, p)) in frozen
    )
    # the merged model (what an HF export writes) computes the adapted model's logits
    adapted = trainer.model_from_state(out.state)
    images = jnp.asarray(np.stack(draw_shapes(4, seed=5)["pixel_values"]), jnp.float32)
    ours = nnx.jit(lambda m, x: m(x))(adapted, images)
    merged = nnx.jit(lambda m, x: m(x))(merge_lora(adapted), images)
    np.testing.assert_allclose(np.asarray(merged), np.asarray(ours), atol=1e-5, rtol=1e-5)
    assert jax.tree.leaves(nnx.state(merge_lora(adapted), Frozen)) == []


def test_cli_refuses_lora_targets_the_model_lacks(tmp_path):
    argv = [
        "train", "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
        "--warmup_steps", "0", "--total_batch_size", "4", "--max_sequence_length", "32",
        "--data.max_train_bytes", "200000", "--data.vocab_size", "384",
        "--model.hidden_size", "32", "--model.intermediate_size", "64",
        "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
        "--model.num_key_value_heads", "1", "--lora_rank", "4",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "jaxtrain.cli", *argv, *extra],
            capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
        )  # fmt: skip

    result = run("--lora_targets", "q_proj,c_attn")  # GPT-2's fused q/k/v, not a Llama's
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "lora_targets" in result.stderr and "'c_attn'" in result.stderr
    assert "q_proj" in result.stderr.split("targets that do:")[1]  # what the model does have
    result = run("--lora_targets", "embeddings")  # no model has it: the field check says so
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "lora_targets" in result.stderr and "embeddings" in result.stderr

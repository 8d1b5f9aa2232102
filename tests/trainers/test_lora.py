"""LoRA: only adapters are trained and held in the optimizer state, the base stays bit for
bit, the merged and PEFT exports give the adapted model's logits in transformers, and a
resumed run (dropout on) ends exactly where an uninterrupted one does."""

from __future__ import annotations

import json

import datasets
import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file
from trainer_fixtures import tiny_arguments, tiny_model

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.models.frozen import Frozen

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1, lora_targets=["attention", "mlp"])


def text_rows(n: int = 16) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [{"text": f"what is {i % 7} + {i % 5} ? {i % 7 + i % 5}"} for i in range(n)]
    )


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


@pytest.fixture(scope="module")
def run(tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    model = tiny_model(seed=3)
    base = {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    args = tiny_arguments(TrainingArguments, tmp, max_steps=4, save_steps=2, **LORA)
    trainer = Trainer(
        arguments=args, model=model, dataset_train=text_rows(), processing_class=tokenizer
    )
    out = trainer.train()
    return trainer, out, base, tmp


def test_only_adapters_are_trained_and_in_the_optimizer_state(run):
    trainer, out, _, _ = run
    params = flat(out.state.params)
    assert params and all("['lora']['a']" in k or "['lora']['b']" in k for k in params)
    adapter_shapes = {v.shape for v in params.values()}
    for key, leaf in flat(out.state.opt_state).items():
        assert leaf.ndim == 0 or leaf.shape in adapter_shapes, key
    assert any(np.abs(v).max() > 0 for k, v in params.items() if "['b']" in k)
    assert trainer.num_parameters == sum(v.size for v in params.values())


def test_base_weights_stay_bit_identical(run):
    trainer, _, base, _ = run
    frozen = {
        "/".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(trainer.program.rest)
        if isinstance(v, Frozen)
    }
    assert frozen.keys() == base.keys()
    for path, value in base.items():
        assert np.array_equal(frozen[path], value), path


def adapted_logits(trainer, state, ids):
    model = trainer.model_from_state(state)
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))


def test_merged_and_peft_exports_match_the_adapted_model_in_transformers(run):
    trainer, out, _, tmp = run
    ids = np.random.default_rng(0).integers(5, 32, (2, 12))
    ours = adapted_logits(trainer, out.state, ids)
    merged = trainer.save_pretrained(out.state, tmp / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager")
    with torch.no_grad():
        theirs = hf.eval()(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)

    # PEFT directory: W + alpha / r * B A on every listed module gives the same logits.
    adapter = trainer.save_pretrained(out.state, tmp / "peft", lora_format="peft")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    base = Trainer(arguments=tiny_arguments(TrainingArguments, tmp / "x"), model=tiny_model(seed=3))
    base.save_pretrained(base.create_state(), tmp / "base")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base").eval()
    scale = config["lora_alpha"] / config["r"]
    weights = dict(hf_base.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." not in name:
                continue
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
            weights[target].add_(torch.as_tensor(scale * b @ a))
        peft_logits = hf_base(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, peft_logits, rtol=1e-4, atol=1e-4)


def test_resume_with_lora_is_exact(run, tokenizer):
    trainer, out, _, tmp = run
    args = tiny_arguments(
        TrainingArguments,
        tmp / "resumed",
        max_steps=4,
        resume_from=str(tmp / "run" / "checkpoints" / "2"),
        **LORA,
    )
    resumed = Trainer(
        arguments=args,
        model=tiny_model(seed=3),
        dataset_train=text_rows(),
        processing_class=tokenizer,
    ).train()
    a, b = flat(out.state.params), flat(resumed.state.params)
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key


def test_bad_lora_arguments_name_the_field():
    with pytest.raises(ArgumentError, match="lora_targets.*embeddings"):
        TrainingArguments(lora_rank=4, lora_targets=["embeddings"])
    with pytest.raises(ArgumentError, match="lora_dropout"):
        TrainingArguments(lora_rank=4, lora_dropout=1.5)


def test_dpo_with_lora_on_a_mesh_trains_like_one_device(tmp_path):
    """DPO + LoRA on dp2 x fsdp2 x tp2 (8 CPU devices): the same losses as one device, and the
    frozen LoRA base (the reference too: no copy of it exists) is sharded by the rules, not
    replicated."""
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("sharded_worker.py")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    single, mesh = results["single"], results["dp2_fsdp2_tp2"]
    np.testing.assert_allclose(mesh["losses"], single["losses"], rtol=2e-4)
    assert not any("reference" in k for k in mesh["specs"])  # the base is the reference
    qkv = [v for k, v in mesh["specs"].items() if k.endswith("qkv_proj/kernel")]
    assert qkv and all(("fsdp" in v and "tp" in v) for v in qkv), mesh["specs"]

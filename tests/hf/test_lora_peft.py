"""LoRA with PEFT's meaning of target_modules, checked with PEFT's own code: the same
trainable-parameter count as `get_peft_model`, and PEFT loading jaxtrain's adapter directory
gives jaxtrain's adapted (and merged) logits. Llama (fused q/k/v and gate/up kernels, split
into per-module adapters) and GPT-2 (c_attn, c_proj, c_fc)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import CASES, forward, hf_gpt2, hf_logits, hf_model, random_ids

peft = pytest.importorskip("peft")

from jaxtrain.errors import ArgumentError  # noqa: E402
from jaxtrain.hf import from_pretrained  # noqa: E402
from jaxtrain.hf.peft import save_peft_adapter  # noqa: E402
from jaxtrain.models.lora import apply_lora, merge_lora  # noqa: E402

RANK, ALPHA = 4, 8.0


def peft_trainable(hf, targets: list[str]) -> int:
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    model = peft.get_peft_model(hf, config)
    trainable, _ = model.get_nb_trainable_parameters()
    model.unload()  # PEFT adapts `hf` in place: give the plain model back
    return trainable


def trainable(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def randomize_b(model, seed: int = 1) -> None:
    """B starts at zero (the adapter is a no-op); give every B values so that a wrong
    placement or split shows in the logits."""
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        if path[-1] == "b":
            var.set_value(0.5 * jax.random.normal(jax.random.fold_in(key, i), var.shape))
    nnx.update(model, nnx.state(model, nnx.Param))


def base_pair(kind: str, tmp_path):
    if kind == "gpt2":
        hf = hf_gpt2(seed=2)
    else:
        config = CASES["llama"]()  # 4 query heads on 2 kv heads: q/k/v sizes differ
        hf = hf_model(config, seed=2)
    hf.save_pretrained(tmp_path / "base")
    return hf, from_pretrained(tmp_path / "base")


def peft_logits(hf, adapter, ids) -> np.ndarray:
    loaded = peft.PeftModel.from_pretrained(hf, adapter).eval()
    try:
        return hf_logits(loaded, ids)
    finally:
        loaded.unload()


@pytest.mark.parametrize(
    "kind,targets,peft_targets",
    [
        ("llama", ["q_proj", "v_proj"], None),
        ("llama", ["k_proj", "gate_proj", "down_proj"], None),
        ("llama", ["attention", "up_proj"], None),  # o and fused qkv whole, up alone
        ("gpt2", ["attention", "mlp"], ["c_attn", "c_proj", "c_fc"]),
        ("gpt2", ["c_attn"], ["c_attn"]),
    ],
)
def test_peft_counts_and_loads_jaxtrain_adapters(kind, targets, peft_targets, tmp_path):
    hf, model = base_pair(kind, tmp_path)
    apply_lora(model, rank=RANK, alpha=ALPHA, targets=targets)
    randomize_b(model)
    ids = random_ids((2, 12), seed=4)
    adapted = np.asarray(forward(model, jnp.asarray(ids)))
    merged = np.asarray(forward(merge_lora(model), jnp.asarray(ids)))
    np.testing.assert_allclose(merged, adapted, atol=1e-4, rtol=1e-4)

    adapter = save_peft_adapter(model, tmp_path / "adapter")
    written = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    if peft_targets is None:  # the Llama part names are PEFT's target_modules themselves
        peft_targets = [t for t in targets if t.endswith("_proj")]
        if "attention" in targets:
            peft_targets += ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert sorted(written) == sorted(peft_targets)
        # PEFT's count: one A [r, in] and one B [out, r] per module. A whole-kernel fused
        # adapter (lora_targets "attention") shares A across q/k/v, so it has fewer.
        if "attention" not in targets:
            assert trainable(model) == peft_trainable(hf, peft_targets)
    else:
        assert trainable(model) == peft_trainable(hf, peft_targets)
    theirs = peft_logits(hf, adapter, ids)
    np.testing.assert_allclose(theirs, adapted, atol=1e-4, rtol=1e-4)
    base = hf_logits(hf, ids)
    assert np.abs(theirs - base).max() > 1e-2  # the adapters do change the logits


def test_q_and_v_targets_leave_k_untouched(tmp_path):
    _, model = base_pair("llama", tmp_path)
    before = np.asarray(model.model.layers[0].self_attn.qkv_proj.kernel[...])
    apply_lora(model, rank=RANK, alpha=ALPHA, targets=["q_proj", "v_proj"])
    randomize_b(model)
    merged = merge_lora(model)
    after = np.asarray(merged.model.layers[0].self_attn.qkv_proj.kernel[...])
    g = model.config.num_queries_per_kv  # kernel [D, K, G + 2, H]: q, then k, then v
    np.testing.assert_array_equal(after[:, :, g], before[:, :, g])
    assert np.abs(after[:, :, :g] - before[:, :, :g]).max() > 1e-3
    assert np.abs(after[:, :, g + 1] - before[:, :, g + 1]).max() > 1e-3
    lora = model.model.layers[0].self_attn.qkv_proj.lora
    assert sorted(lora.parts) == ["q_proj", "v_proj"]


def test_targets_naming_nothing_of_the_model_are_refused(tmp_path):
    _, model = base_pair("llama", tmp_path)
    with pytest.raises(ArgumentError, match=r"lora_targets.*'c_attn'.*q_proj"):
        apply_lora(model, rank=RANK, alpha=ALPHA, targets=["q_proj", "c_attn"])
    _, gpt2 = base_pair("gpt2", tmp_path / "g")
    with pytest.raises(ArgumentError, match=r"\['q_proj'\].*GPT2LMHeadModel.*c_attn"):
        apply_lora(gpt2, rank=RANK, alpha=ALPHA, targets=["q_proj"])


def test_a_local_base_is_written_as_an_absolute_path(tmp_path, monkeypatch):
    """A relative base directory would name another directory, or none, when the adapter is
    loaded from elsewhere (`jaxtrain serve|evaluate ADAPTER` from another directory); a Hub
    id, which names no local directory, is written as given."""
    _, model = base_pair("llama", tmp_path)
    apply_lora(model, rank=RANK, alpha=ALPHA)
    (tmp_path / "bases" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for given, written in [
        ("bases/tiny", str(tmp_path / "bases" / "tiny")),
        ("org/tiny", "org/tiny"),
    ]:
        adapter = save_peft_adapter(model, tmp_path / "adapter", base_model=given)
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == written

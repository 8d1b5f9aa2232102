"""Load real transformers checkpoints into jaxtrain: same logits and loss as PyTorch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_fixtures import CASES, forward, hf_logits, random_ids, save_hf

from jaxtrain.hf import AutoModelForCausalLM
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.training.step import IGNORE_INDEX, causal_lm_sums


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_loss_match_transformers(name, tmp_path):
    reference_model = save_hf(name, tmp_path)
    ids = random_ids((2, 24), seed=1)
    reference = hf_logits(reference_model, ids)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.model_type == reference_model.config.model_type
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == model.config.num_parameters() == reference_model.num_parameters()
    logits = forward(model, jnp.asarray(ids))
    assert logits.dtype == jnp.float32
    assert relative_error(logits, reference) < 2e-5

    # The loss on labelled tokens (some positions ignored) agrees with transformers' own.
    labels = ids.copy()
    labels[0, :5] = IGNORE_INDEX
    labels[1, 10:] = IGNORE_INDEX
    with torch.no_grad():
        hf_loss = reference_model(torch.as_tensor(ids), labels=torch.as_tensor(labels)).loss
    sums = causal_lm_sums(logits, jnp.asarray(labels))
    ours = float(sums["loss_sum"] / sums["tokens"])
    assert abs(ours - float(hf_loss)) < 1e-5 * max(1.0, float(hf_loss))


def test_features_are_really_exercised(tmp_path):
    """The parity cases above would pass trivially if a feature were a no-op: check that
    dropping each feature changes the logits."""
    ids = jnp.asarray(random_ids((1, 24), seed=2))
    for name, field, off in [
        ("mistral_sliding_window", "sliding_window", None),
        ("llama3_rope", "rope_scaling", None),
        ("qwen3_qk_norm", "qk_norm", False),
    ]:
        save_hf(name, tmp_path / name)
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        changed = LlamaConfig.from_dict({**model.config.to_dict(), field: off})
        other = nnx.eval_shape(lambda c=changed: LlamaForCausalLM(c, rngs=nnx.Rngs(0)))
        kept = [
            (path, var)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
            if "q_norm" not in path and "k_norm" not in path
        ]
        nnx.update(other, nnx.from_flat_state(kept))
        assert relative_error(forward(other, ids), np.asarray(forward(model, ids))) > 1e-3, name


def test_dtype_and_param_dtype_are_honoured(tmp_path):
    reference_model = save_hf("llama", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16
    )
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
    ids = random_ids((1, 16))
    logits = forward(model, jnp.asarray(ids))
    assert logits.dtype == jnp.bfloat16
    reference = hf_logits(reference_model, ids)
    assert relative_error(logits.astype(jnp.float32), reference) < 5e-2


def test_sharded_checkpoint_with_index_loads(tmp_path):
    reference_model = save_hf("qwen2_bias", tmp_path, max_shard_size="20KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    ids = random_ids((2, 12))
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert relative_error(forward(model, jnp.asarray(ids)), hf_logits(reference_model, ids)) < 2e-5


def test_bf16_checkpoint_loads_into_float32(tmp_path):
    reference_model = save_hf("llama_tied", tmp_path)
    reference_model.to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    embedding = nnx.state(model, nnx.Param)["model"]["embed_tokens"]["embedding"][...]
    assert embedding.dtype == jnp.float32
    expected = reference_model.model.embed_tokens.weight.float().detach().numpy()
    np.testing.assert_array_equal(np.asarray(embedding), expected)

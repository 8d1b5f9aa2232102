"""Qwen2.5-VL equals transformers' Qwen2_5_VLForConditionalGeneration on the same weights: two
images of different sizes (transformers' own image processor's patches and grids) in two rows
and a left-padded text row, float32, eager attention, rel 1e-4; windowed attention is
exercised (full attention everywhere gives other logits); M-RoPE positions equal HF's
get_rope_index; a transformers directory loads with `AutoModelForCausalLM`, and jaxtrain's
export loads back in transformers with the same logits (issue 50)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from jaxtrain.errors import HFError
from jaxtrain.hf.qwen25_vl import load_qwen25_vl
from jaxtrain.models.classes import classes_for
from jaxtrain.models.llama import LlamaForCausalLM
from jaxtrain.models.qwen25_vl import Qwen25VLConfig, rope_positions
from jaxtrain.models.qwen25_vl_vision import row_layouts, vision_layout

IMG, START, END, PAD = 250, 251, 252, 0
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                             "rope_theta": 10000.0})  # fmt: skip
# window_size 56 = 2 merge units of 2 patches of 14: the 8 x 8 patch image has 4 windows, the
# 4 x 6 one 2; block 1 attends across each whole image.
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
              window_size=56, fullatt_block_indexes=[1], initializer_range=0.05)  # fmt: skip


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Qwen2_5_VLConfig(
        text_config=TEXT, vision_config=VISION, image_token_id=IMG,
        vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def batch():
    """(input_ids [3, T], attention_mask, pixel_values [88, 1176], image_grid_thw [2, 3])."""
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}
    )
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
              for shape in ((112, 112, 3), (56, 84, 3))]  # fmt: skip
    out = processor(images, return_tensors="np")
    pixels, grids = out["pixel_values"].astype(np.float32), np.asarray(out["image_grid_thw"])
    a, b = (int(np.prod(g)) // 4 for g in grids)  # merged tokens per image
    rows = [[1, 3, START, *[IMG] * a, END, 4, 5, 6], [7, START, *[IMG] * b, END, 8, 9]]
    length = max(map(len, rows)) + 2
    rows = [r + list(range(20, 20 + length - len(r))) for r in rows]
    rows.append([PAD] * 5 + list(range(30, 30 + length - 5)))  # a left-padded text row
    ids = np.array(rows)
    mask = np.ones_like(ids)
    mask[2, :5] = 0
    return ids, mask, pixels, grids


def hf_logits(model, ids, mask, pixels, grids):
    with torch.no_grad():
        return model(
            input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
            pixel_values=torch.as_tensor(pixels), image_grid_thw=torch.as_tensor(grids),
            mm_token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
        ).logits.numpy()  # fmt: skip


def weights_of(hf_model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}


def assert_close(ours, theirs, mask) -> float:
    """Equal on the real tokens at rel 1e-4 of the logits' scale; the relative difference."""
    real = np.asarray(mask, bool)
    diff = np.abs(np.asarray(ours) - theirs)[real].max() / np.abs(theirs[real]).max()
    assert diff < 1e-4, diff
    return float(diff)


def test_logits_with_images_of_two_sizes_equal_transformers(hf_model, batch):
    ids, mask, pixels, grids = batch
    theirs = hf_logits(hf_model, ids, mask, pixels, grids)
    model = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model))
    ours = model(jnp.asarray(ids), jnp.asarray(pixels), grids, attention_mask=jnp.asarray(mask))
    assert_close(ours, theirs, mask)
    # The images reach the logits: other pixels, other logits.
    other = model(
        jnp.asarray(ids), jnp.asarray(pixels[::-1]), grids, attention_mask=jnp.asarray(mask)
    )
    assert np.abs(np.asarray(other) - ours)[:2].max() > 1e-2

    # A text row is the plain Qwen2 decoder's (the same weights in a LlamaForCausalLM).
    text = LlamaForCausalLM(model.config.text, rngs=nnx.Rngs(0))
    nnx.update(text.model, nnx.state(model.model, nnx.Param))
    nnx.update(text.lm_head, nnx.state(model.lm_head, nnx.Param))
    row, row_mask = jnp.asarray(ids[2:]), jnp.asarray(mask[2:])
    plain = np.asarray(text(row, attention_mask=row_mask))
    np.testing.assert_allclose(np.asarray(model(row, attention_mask=row_mask)), plain,
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_windowed_attention_is_exercised(hf_model, batch):
    ids, mask, pixels, grids = batch
    config = hf_model.config.to_dict()
    layout = vision_layout(grids, load_qwen25_vl(config, weights_of(hf_model)).config.vision)
    assert len(set(layout.windows.tolist())) == 6 and len(set(layout.frames.tolist())) == 2
    config["vision_config"]["fullatt_block_indexes"] = [0, 1, 2]
    full = load_qwen25_vl(config, weights_of(hf_model))
    theirs = hf_logits(hf_model, ids, mask, pixels, grids)
    ours = np.asarray(
        full(jnp.asarray(ids), jnp.asarray(pixels), grids, attention_mask=jnp.asarray(mask))
    )
    assert np.abs(ours - theirs)[:2].max() > 100 * 1e-4 * np.abs(theirs).max()


def test_rope_positions_equal_get_rope_index(hf_model, batch):
    ids, mask, _, grids = batch
    theirs, _ = hf_model.model.get_rope_index(
        torch.as_tensor(ids), mm_token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
        image_grid_thw=torch.as_tensor(grids), attention_mask=torch.as_tensor(mask),
    )  # fmt: skip
    config = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model)).config
    np.testing.assert_array_equal(rope_positions(ids, grids, config, mask), theirs.numpy())
    with pytest.raises(ValueError, match="cut"):  # an image's tokens one short
        rope_positions(np.delete(ids[:1], 4, axis=1), grids[:1], config)


def test_under_jit_with_host_positions_and_padded_patches(hf_model, batch):
    """The jit path: positions and the tower's layout computed on the host, pixel_values
    padded to a fixed number of patches (the program depends on that number only)."""
    ids, mask, pixels, grids = batch
    theirs = hf_logits(hf_model, ids, mask, pixels, grids)
    model = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model))
    padded = np.concatenate([pixels, np.ones((12, pixels.shape[1]), np.float32)])
    layout = vision_layout(grids, model.config.vision, num_patches=len(padded))
    positions = rope_positions(ids, grids, model.config, mask)

    @nnx.jit
    def forward(model, ids, pixels, layout, positions, mask):
        return model(ids, pixels, layout=layout, positions=positions, attention_mask=mask)

    ours = forward(model, jnp.asarray(ids), jnp.asarray(padded), layout, jnp.asarray(positions),
                   jnp.asarray(mask))  # fmt: skip
    assert_close(ours, theirs, mask)


def test_config_round_trip_and_parameter_count(hf_model):
    model = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model))
    config = model.config
    assert Qwen25VLConfig.from_dict(config.to_dict()) == config
    assert classes_for("qwen2_5_vl") == (Qwen25VLConfig, type(model))
    count = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert config.num_parameters() == count == sum(p.numel() for p in hf_model.parameters())
    assert config.vocab_size == 256 and config.image_token_id == IMG  # the decoder's, read through


def test_a_missing_tensor_and_another_model_type_are_named(hf_model):
    config, weights = hf_model.config.to_dict(), weights_of(hf_model)
    del weights["model.visual.blocks.2.mlp.up_proj.weight"]
    with pytest.raises(HFError, match=r"visual\.blocks\.2\.mlp\.up_proj\.weight"):
        load_qwen25_vl(config, weights)
    with pytest.raises(HFError, match="'qwen2' is not 'qwen2_5_vl'"):
        load_qwen25_vl({**config, "model_type": "qwen2"}, weights)


def test_a_transformers_directory_loads_and_exports_back(hf_model, batch, tmp_path):
    from jaxtrain.hf import AutoModelForCausalLM, save_pretrained

    ids, mask, pixels, grids = batch
    want = hf_logits(hf_model, ids, mask, pixels, grids)
    hf_model.save_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ours = model(jnp.asarray(ids), jnp.asarray(pixels), grids, attention_mask=jnp.asarray(mask))
    assert_close(ours, want, mask)

    save_pretrained(model, tmp_path / "export")
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    assert_close(hf_logits(back, ids, mask, pixels, grids), want, mask)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert dataclasses.asdict(again.config) == dataclasses.asdict(model.config)


def test_the_hubs_flat_config_reads_as_transformers_5s_nested_one(hf_model):
    from jaxtrain.hf.qwen25_vl import from_hf_qwen25_vl_config, to_hf_qwen25_vl_config

    nested = hf_model.config.to_dict()
    text = {k: v for k, v in nested["text_config"].items() if k != "rope_parameters"}
    # The Hub's configs (Qwen/Qwen2.5-VL-*): text fields at the top, M-RoPE as rope_scaling.
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **text,
            "model_type": "qwen2_5_vl", "rope_theta": 10000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}  # fmt: skip
    config = from_hf_qwen25_vl_config(nested)
    assert from_hf_qwen25_vl_config(flat) == config
    assert from_hf_qwen25_vl_config(to_hf_qwen25_vl_config(config)) == config
    assert config.mrope_section == (2, 3, 3) and config.vision.fullatt_block_indexes == (1,)


def test_lora_adapts_the_decoder_only(hf_model, batch):
    from jaxtrain.models.lora import apply_lora, lora_projections

    ids, mask, pixels, grids = batch
    model = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model))
    before = model(jnp.asarray(ids), jnp.asarray(pixels), grids, attention_mask=jnp.asarray(mask))
    apply_lora(model, rank=2, alpha=4.0)
    adapted = {str(path[0]) for path, _ in lora_projections(model)}
    assert adapted == {"model"} and len(lora_projections(model)) == 2 * 4  # qkv, o, gate_up, down
    after = model(jnp.asarray(ids), jnp.asarray(pixels), grids, attention_mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=1e-6, atol=1e-6)


def test_per_row_patches_equal_the_flat_ones(hf_model, batch):
    """Each row's images in its own slot [B, N, patch_dim] (padded; the text row all padding),
    as a data-parallel batch holds them: the logits of the flat batch, transformers'."""
    ids, mask, pixels, grids = batch
    theirs = hf_logits(hf_model, ids, mask, pixels, grids)
    model = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model))
    first = int(np.prod(grids[0]))
    slots = np.zeros((3, first, pixels.shape[1]), np.float32)
    slots[0], slots[1, : len(pixels) - first] = pixels[:first], pixels[first:]
    layout = row_layouts([grids[:1], grids[1:], grids[:0]], model.config.vision, first)
    ours = model(
        jnp.asarray(ids), jnp.asarray(slots), grids, layout=layout, attention_mask=jnp.asarray(mask)
    )
    assert_close(ours, theirs, mask)


def test_freeze_vision_tower_keeps_the_tower_not_its_merger(hf_model):
    """`freeze_vision_tower`: the patch embedding and blocks become frozen; the merger (the
    projector) and the decoder stay trainable (as Gemma 3's projector does)."""
    from flax import nnx

    from jaxtrain.config.sections import ModelSettings
    from jaxtrain.models.frozen import Frozen
    from jaxtrain.training.program import adapt

    model = load_qwen25_vl(hf_model.config.to_dict(), weights_of(hf_model))
    settings = ModelSettings(dtype=None, param_dtype=None, remat_policy="none", lora_rank=0,
                             lora_alpha=16.0, lora_dropout=0.0, lora_targets=None, seed=0,
                             quantization=None, quantization_block_size=64,
                             quantization_double=False, scan_layers=False,
                             freeze_vision_tower=True)  # fmt: skip
    adapt(model, settings)
    kinds = {"/".join(map(str, p)): type(v) for p, v in nnx.iter_graph(model)
             if isinstance(v, nnx.Variable)}  # fmt: skip
    tower = [k for k in kinds if k.startswith(("visual/patch_embed", "visual/blocks"))]
    assert tower and all(kinds[k] is Frozen for k in tower)
    rest = [k for k in kinds if k.startswith(("visual/merger", "model/"))]
    assert rest and all(kinds[k] is nnx.Param for k in rest)

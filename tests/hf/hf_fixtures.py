"""Tiny real transformers models and tokenizers for the HF interop tests (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers
from flax import nnx

VOCAB = 320
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # larger than HF's 0.02 so logits differ visibly between tokens
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> HF config; each exercises one feature of the mapping.
CASES = {
    "llama": lambda: transformers.LlamaConfig(**BASE),
    "llama_tied": lambda: transformers.LlamaConfig(**BASE, tie_word_embeddings=True),
    "llama_mha_mlp_bias": lambda: transformers.LlamaConfig(
        **{**BASE, "num_key_value_heads": 4}, mlp_bias=True
    ),
    "llama3_rope": lambda: transformers.LlamaConfig(**BASE, rope_scaling=dict(LLAMA3_ROPE)),
    "mistral_sliding_window": lambda: transformers.MistralConfig(**BASE, sliding_window=5),
    "qwen2_bias": lambda: transformers.Qwen2Config(**BASE),
    "qwen3_qk_norm": lambda: transformers.Qwen3Config(**BASE, head_dim=8),
}

GEMMA = dict(BASE, num_hidden_layers=3, head_dim=8, sliding_window=5, query_pre_attn_scalar=16)
GEMMA_CASES = {
    # Soft-capped attention and logits, alternating sliding/full layers, tied embeddings.
    "gemma2": lambda: transformers.Gemma2Config(
        **GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
    ),
    # q/k norm, a separate rope base for the sliding layers, an untied head.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **GEMMA,
        tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),  # fmt: skip
}


def hf_model(config: transformers.PretrainedConfig, seed: int = 0):
    """An eval-mode transformers model whose norms and biases are random too (HF initialises
    them to 1 and 0, which would hide a mapping error on them)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def hf_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """A tiny eval-mode GPT-2 with random norms and biases (64 positions)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # random norms and biases: a mapping error on them must show
        for name, param in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def save_hf(
    name: str, directory: Path, *, layers: int = 2, **save_kwargs
) -> transformers.PreTrainedModel:
    config = CASES[name]()
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    model = hf_model(config)
    model.save_pretrained(directory, **save_kwargs)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def random_ids(shape: tuple[int, int], seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, size=shape)


def tiny_tokenizer(directory: Path | None = None) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of < VOCAB tokens learned in well under a second."""
    from tokenizers import ByteLevelBPETokenizer

    text = [
        "def add(a, b):\n    return a + b\n",
        "the quick brown fox jumps over the lazy dog\n",
        "import os\nprint(os.getcwd())\n",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        text, vocab_size=VOCAB - 8, min_frequency=1, special_tokens=["<s>", "</s>", "<pad>"]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if directory is not None:
        tokenizer.save_pretrained(directory)
    return tokenizer


@nnx.jit
def forward(model, ids):
    """Jitted logits: one compile is much faster than eager op-by-op dispatch."""
    return model(ids)

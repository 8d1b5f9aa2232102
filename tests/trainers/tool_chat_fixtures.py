"""A tokenizer that speaks tools (Qwen 2.5's chat template, as TRL ships it, over a small
byte-level BPE trained here), tools to call, and a tiny Llama of its vocabulary: shared by
the tool-calling GRPO tests."""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def broken(text: str) -> str:
    """A tool that always fails.

    Args:
        text: Anything.
    """
    raise RuntimeError("the broken tool broke")


def tool_tokenizer(template: str, sample_texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `sample_texts` (so the chat template's own text is a few
    tokens), with ChatML's special tokens and `template`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(sample_texts * 4, trainer)
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    out.chat_template = template
    return out


def tiny_llama(tokenizer, path: Path, seed: int = 0) -> Path:
    import torch

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(path)
    return path

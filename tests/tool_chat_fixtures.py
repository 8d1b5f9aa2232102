"""A tokenizer that speaks tools (Qwen 2.5's chat template, as TRL ships it, over a small
byte-level BPE trained here), tools to call, and a tiny Llama of its vocabulary: shared by
the tool-calling GRPO tests."""

from __future__ import annotations

import functools
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# XLA options of a compile whose program runs many times (tool_caller's training step).
EXECUTING = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}


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


def tool_caller(tokenizer, conversations: list[list[dict]], tools: list, answer: str, steps=100):
    """A tiny jaxtrain Llama trained (adam, `steps` full-batch steps) to answer each of
    `conversations` (shown `tools`) with `answer`: a model that calls a tool when asked."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxtrain.data.collate import IGNORE_INDEX
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.trainers.grpo_prompts import chat_ids
    from jaxtrain.training.logps import model_token_logps

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    if not steps:
        return model
    reply = tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for messages in conversations:
        prompt = chat_ids(tokenizer, messages, tools)
        ids.append(prompt + reply)
        labels.append([IGNORE_INDEX] * len(prompt) + reply)
    width = max(map(len, ids))
    ids = jnp.asarray([x + [0] * (width - len(x)) for x in ids])
    labels = jnp.asarray([x + [IGNORE_INDEX] * (width - len(x)) for x in labels])
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # 100 steps at 1e-2 end at a lower loss than 300 at 3e-3 did (0.0026 against 0.0039 per
    # token on test_grpo_tools' 16 conversations), at a third of the steps.
    adam = optax.adam(1e-2)

    def loss(params):
        logps, mask = model_token_logps(nnx.merge(graphdef, params, rest), ids, labels)
        return -(logps * mask).sum() / mask.sum()

    # The steps execute more than they compile: XLA's level 1, not the suite's level 0 (whose
    # steps run ~4x slower, tests/conftest.py).
    @functools.partial(jax.jit, compiler_options=EXECUTING)
    def step(params, moments):
        value, grads = jax.value_and_grad(loss)(params)
        updates, moments = adam.update(grads, moments, params)
        return optax.apply_updates(params, updates), moments, value

    moments = adam.init(params)
    for _ in range(steps):
        params, moments, value = step(params, moments)
    assert float(value) < 0.05, f"the caller did not learn its answer (loss {float(value)})"
    nnx.update(model, params)
    return model

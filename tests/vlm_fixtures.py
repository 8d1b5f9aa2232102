"""A tiny Gemma 3 vision-language checkpoint on disk, written by transformers: random weights,
a word-level tokenizer with Gemma 3's image tokens and a chat template, and Gemma 3's image
processor (PIL path) at 32 x 32 pixels; plus image conversations in TRL's vision format."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import numpy as np

WORDS = [
    "what",
    "is",
    "in",
    "the",
    "picture",
    "a",
    "red",
    "square",
    "blue",
    "circle",
    "green",
    "it",
    "shows",
    "describe",
    "this",
    "image",
    "colour",
    "of",
    "shape",
    "and",
    "two",
    "left",
    "right",
    "small",
    "big",
]
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
           "<start_of_image>", "<end_of_image>", "<image_soft_token>"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %} "
    "{% endfor %}{% endif %}<end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model {% endif %}"
)
TOKENS_PER_IMAGE = 4
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)  # fmt: skip
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=10000.0,
            query_pre_attn_scalar=16)  # fmt: skip


def processor():
    """A Gemma3Processor on the word-level vocabulary (image token: <image_soft_token>)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    vocab = {t: i for i, t in enumerate(SPECIAL + ["user", "model"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={"boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[4:]})
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )  # fmt: skip


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random Gemma3ForConditionalGeneration and its processor saved in `path`."""
    import torch
    import transformers

    proc = processor()
    tokenizer = proc.tokenizer
    config = transformers.Gemma3Config(
        text_config={**TEXT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                     "bos_token_id": tokenizer.bos_token_id,
                     "eos_token_id": tokenizer.eos_token_id},
        vision_config=VISION, mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    projector = model.model.multi_modal_projector
    with torch.no_grad():  # zeros at init: random, so that the images matter
        projector.mm_input_projection_weight.normal_(0, 0.2)
        projector.mm_soft_emb_norm.weight.normal_(0, 0.2)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


def picture(seed: int, height: int = 24, width: int = 40):
    """A random RGB PIL image (sizes differ: the processor resizes)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def conversations(n: int = 8) -> list[dict]:
    """Image conversations in TRL's vision format (one image each, some two, some none)."""
    shapes = ["a red square", "a blue circle", "two green shape", "a small red circle"]
    rows = []
    for i in range(n):
        images = [picture(i, 20 + 4 * i, 30)] + ([picture(100 + i)] if i % 3 == 1 else [])
        if i % 4 == 3:
            images = []
        question = "describe this image" if images else "what is a square"
        rows.append({
            "images": images,
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"it shows {shapes[i % 4]}"},
            ],
        })  # fmt: skip
    return rows

"""A vision-language SFT step on CPU: packed against padded rows, and whether image
preprocessing keeps up with the step (issue 50).

    .venv/bin/python bench/vlm.py                    # 3 rounds (~6 min on 2 quiet cores)
    .venv/bin/python bench/vlm.py --rounds 1 --steps 4 --check

A Gemma 3 with images (decoder: hidden 256, 4 layers; SigLIP tower: hidden 192, 4 layers,
128 x 128 images of 64 patches, 16 tokens each) fine-tunes with `SFTTrainer` on 256 image
conversations of 20-160 words (one image in most rows, two in some, none in a few), rows of
512 tokens, 8 rows a step. Each variant runs in its own process, the order alternating
between rounds:

- ``padded``: one conversation a row (`packing=False`, `images_per_row=2`);
- ``packed``: conversations packed into the rows while their tokens fit and their images fit
  `images_per_row=8` slots (`packing=True`).

Each worker reports the steady step time (median of steps 3..N), the tokens a step trains on
(the replies' tokens: labels, not padding, prompts or images), their rate, and its peak RSS. A third measurement, in the first worker of
each round, is preprocessing alone: the VisionFeaturizer (the processor's PIL resize and
normalisation, the chat template, the tokenizer) over the rows, as rows/s and image tokens/s,
against the rows/s the packed step consumes.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ["the", "a", "red", "green", "blue", "square", "circle", "shape", "small", "big", "left", "right", "picture", "image", "shows", "colour", "of", "and", "is", "in", "on", "with", "it", "what", "describe", "this", "two", "one"]  # fmt: skip
VARIANTS = {"padded": dict(packing=False, images_per_row=2),
            "packed": dict(packing=True, images_per_row=8)}  # fmt: skip
SEQ, ROWS, IMAGE, TOKENS_PER_IMAGE = 512, 8, 128, 16


def processor():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>",
               "<image_soft_token>", "<|user|>", "<|assistant|>"]  # fmt: skip
    vocab = {t: i for i, t in enumerate(special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={"boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": special[4:]})
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {% for p in m['content'] %}"
                "{% if p['type'] == 'image' %}<start_of_image> {% else %}{{ p['text'] }} "
                "{% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")  # fmt: skip
    images = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
    return transformers.Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=template,
        image_seq_length=TOKENS_PER_IMAGE,
    )


def conversations(n: int, seed: int = 0) -> list[dict]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        count = 0 if i % 16 == 7 else (2 if i % 5 == 3 else 1)
        size = lambda: tuple(int(x) for x in rng.integers(64, 256, 2))  # noqa: E731
        images = [Image.fromarray(rng.integers(0, 256, (*size(), 3), dtype=np.uint8))
                  for _ in range(count)]  # fmt: skip
        words = lambda k: " ".join(rng.choice(WORDS, k))  # noqa: E731
        rows.append({"images": images, "messages": [
            {"role": "user", "content": words(int(rng.integers(10, 40)))},
            {"role": "assistant", "content": words(int(rng.integers(10, 120)))}]})  # fmt: skip
    return rows


def model(vocab: int):
    from flax import nnx

    from jaxtrain.models.gemma import GemmaConfig
    from jaxtrain.models.gemma3_vlm import Gemma3ForConditionalGeneration, Gemma3VisionConfig
    from jaxtrain.models.siglip import SiglipVisionConfig

    text = GemmaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, query_pre_attn_scalar=64, sliding_window=256,
                       rope_local_base_freq=10000.0, qk_norm=True, model_type="gemma3_text",
                       pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    tower = SiglipVisionConfig(hidden_size=192, intermediate_size=768, num_hidden_layers=4,
                               num_attention_heads=4, image_size=IMAGE, patch_size=16)  # fmt: skip
    config = Gemma3VisionConfig(text, tower, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                image_token_id=6, boi_token_id=4, eoi_token_id=5)  # fmt: skip
    return Gemma3ForConditionalGeneration(config, rngs=nnx.Rngs(0))


class Clock:
    """Wall time of each step's end, and the trained (labelled) tokens of each step."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.tokens: list[float] = []

    def on_step_end(self, trainer, state, metrics, step) -> None:
        import jax

        jax.block_until_ready(state)
        self.ends.append(time.perf_counter())
        self.tokens.append(float(metrics["tokens"]))


def preprocessing(proc, rows) -> dict:
    from jaxtrain.data.vision import VisionFeaturizer

    featurizer = VisionFeaturizer(
        name="bench", processor=proc, image_token_id=6, image_shape=(3, IMAGE, IMAGE),
        max_length=SEQ, images_per_row=2, completion_only_loss=True,
    )  # fmt: skip
    start = time.perf_counter()
    examples = featurizer(rows, range(len(rows)))
    seconds = time.perf_counter() - start
    image_tokens = sum(int((e["input_ids"] == 6).sum()) for e in examples)
    return {"rows_per_s": len(rows) / seconds, "image_tokens_per_s": image_tokens / seconds}


def worker(variant: str, steps: int, measure_preprocessing: bool) -> dict:
    import datasets

    from jaxtrain.trainers import SFTArguments, SFTTrainer

    proc = processor()
    rows = conversations(256)
    out = {"variant": variant}
    if measure_preprocessing:
        out["preprocessing"] = preprocessing(proc, rows[:64])
    clock = Clock()
    args = SFTArguments(
        output_dir=tempfile.mkdtemp(), max_steps=steps, total_batch_size=ROWS,
        max_sequence_length=SEQ, learning_rate=1e-4, logging_steps=10**6, save_final=False,
        progress_bar="none", run_report=False, **VARIANTS[variant],
    )  # fmt: skip
    trainer = SFTTrainer(arguments=args, model=model(len(proc.tokenizer)),
                         dataset_train=datasets.Dataset.from_list(rows), processing_class=proc,
                         callbacks=[clock])  # fmt: skip
    trainer.train()
    step_s = statistics.median(np.diff(clock.ends[1:]))  # steps 3..N: compiled, data warm
    tokens = statistics.median(clock.tokens[2:])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.update(step_s=step_s, tokens_per_step=tokens, tokens_per_s=tokens / step_s, peak_rss_mb=rss)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--worker")
    parser.add_argument("--preprocessing", action="store_true")
    parser.add_argument("--check", action="store_true", help="a quick run that proves it works")
    opts = parser.parse_args()
    if opts.worker:
        print("RESULT " + json.dumps(worker(opts.worker, opts.steps, opts.preprocessing)))
        return
    variants = list(VARIANTS)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    pre: list[dict] = []
    load = []
    for r in range(opts.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for i, v in enumerate(order):
            cmd = [sys.executable, __file__, "--worker", v, "--steps", str(opts.steps)]
            cmd += ["--preprocessing"] if i == 0 else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
            result = json.loads(line[7:])
            runs[v].append(result)
            pre += [result["preprocessing"]] if "preprocessing" in result else []
            load.append(Path("/proc/loadavg").read_text().split()[0])
        print(f"round {r + 1}: " + ", ".join(
            f"{v} {runs[v][-1]['tokens_per_s']:.0f} tok/s" for v in variants))  # fmt: skip
    print(f"\n{opts.rounds} rounds x {opts.steps} steps, rows of {SEQ} x {ROWS}; load {load}")
    print("| variant | tokens/step | tokens/s (median) | runs | peak RSS MB | vs padded |")
    print("| --- | --- | --- | --- | --- | --- |")
    for v in variants:
        rate = [x["tokens_per_s"] for x in runs[v]]
        ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                  for a, b in zip(runs[v], runs["padded"]))  # fmt: skip
        print(f"| {v} | {statistics.median(x['tokens_per_step'] for x in runs[v]):.0f} | "
              f"{statistics.median(rate):.0f} | {' / '.join(f'{x:.0f}' for x in rate)} | "
              f"{statistics.median(x['peak_rss_mb'] for x in runs[v]):.0f} | {ratio:.2f}x |")  # fmt: skip
    packed_rows = [ROWS / x["step_s"] for x in runs["packed"]]
    print(
        "\npreprocessing alone: rows/s "
        + " / ".join(f"{p['rows_per_s']:.0f}" for p in pre)
        + ", image tokens/s "
        + " / ".join(f"{p['image_tokens_per_s']:.0f}" for p in pre)
    )
    conv_per_packed_row = statistics.median(
        x["tokens_per_step"] for x in runs["packed"]) / statistics.median(
        x["tokens_per_step"] for x in runs["padded"])  # fmt: skip
    need = statistics.median(packed_rows) * conv_per_packed_row
    print(
        f"the packed step consumes ~{need:.1f} conversations/s; preprocessing gives "
        f"{statistics.median(p['rows_per_s'] for p in pre):.0f}/s"
    )


if __name__ == "__main__":
    main()

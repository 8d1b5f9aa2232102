"""Input pipeline throughput (tokens/s) next to the demo model's training tokens/s.

    .venv/bin/python bench/data_throughput.py                 # ~2 minutes on 2 cores
    .venv/bin/python bench/data_throughput.py --batches 20 --train-steps 20 --json out.json

Every pipeline variant produces batches of the demo's shape (total_batch_size x
max_sequence_length from jaxtrain.cli.run_config.DEFAULT_CONFIG) from the embedded corpus, on one
thread, without prefetch; the Trainer then trains the demo model on the pre-tokenized corpus.
"Tokens" are real (non-padding) tokens in both columns, so the ratio says how many times
faster the input pipeline is than the step it feeds (> 1: the device never waits for data,
given one prefetch thread).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.cli.run_config import DEFAULT_CONFIG
from jaxtrain.data import build_train_loader, chunk_dataset, load_default_corpus
from jaxtrain.models import LlamaConfig, LlamaForCausalLM


def pipeline_rate(name: str, args: TrainingArguments, data, tokenizer, batches: int) -> dict:
    loader = build_train_loader(args, data, tokenizer=tokenizer, pad_token_id=0)
    it = loader.batches()
    next(it)  # first batch: file/stream opening, not steady state
    start = time.perf_counter()
    real = 0
    for _ in range(batches):
        real += int(next(it)["attention_mask"].sum())
    seconds = time.perf_counter() - start
    return {"pipeline": name, "tokens_per_second": real / seconds, "batches": batches}


def train_rate(train_ds, vocab: int, steps: int) -> float:
    cfg = DEFAULT_CONFIG
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **cfg["model"]), rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            logging_steps=steps,
            save_final=False,
            total_batch_size=cfg["total_batch_size"],
            max_sequence_length=cfg["max_sequence_length"],
            learning_rate=cfg["learning_rate"],
            evaluation_strategy="no",
            progress_bar="none",
        )
        output = Trainer(arguments=args, model=model, dataset_train=train_ds).train()
    return float(output.metrics["tokens_per_second"])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    cfg = DEFAULT_CONFIG
    corpus = load_default_corpus(
        vocab_size=cfg["data"]["vocab_size"], max_train_bytes=cfg["data"]["max_train_bytes"]
    )
    tok, seq, batch = corpus.tokenizer, cfg["max_sequence_length"], cfg["total_batch_size"]
    chunked = chunk_dataset(corpus.train, tok, seq)
    common = dict(total_batch_size=batch, max_sequence_length=seq, progress_bar="none")
    plain = TrainingArguments(**common)
    packed = TrainingArguments(**common, packing=True, max_steps=10**6)
    streamed = TrainingArguments(**common, packing=True, streaming=True, max_steps=10**6)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "train.jsonl"
        with jsonl.open("w") as f:
            for text in corpus.train["text"][:2000]:
                f.write(json.dumps({"text": text}) + "\n")
        variants = [
            ("pre-tokenized rows (Dataset)", plain, chunked, None),
            ("raw text, tokenize + pad (Dataset)", plain, corpus.train, tok),
            ("raw text, tokenize + pack (Dataset)", packed, corpus.train, tok),
            (
                "raw text, tokenize + pack (IterableDataset)",
                streamed,
                corpus.train.to_iterable_dataset(num_shards=4),
                tok,
            ),
            ("raw text, tokenize + pack (jsonl stream)", streamed, str(jsonl), tok),
        ]
        rows = [pipeline_rate(n, a, d, t, opts.batches) for n, a, d, t in variants]
    train = train_rate(chunked, len(tok), opts.train_steps)
    print(f"demo model training: {train:,.0f} tokens/s ({batch} x {seq} per step)\n")
    print(f"{'input pipeline':48s} {'tokens/s':>12s} {'x training':>11s}")
    for row in rows:
        row["vs_training"] = row["tokens_per_second"] / train
        print(
            f"{row['pipeline']:48s} {row['tokens_per_second']:12,.0f} {row['vs_training']:10.1f}x"
        )
    if opts.json:
        Path(opts.json).write_text(
            json.dumps({"train_tokens_per_second": train, "pipelines": rows})
        )
    return 0


if __name__ == "__main__":
    datasets.disable_progress_bars()
    np.set_printoptions(precision=3)
    sys.exit(main(sys.argv[1:]))

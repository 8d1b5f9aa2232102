"""Packing utilisation on the stdlib documents: share of row slots that carry a real target.

    .venv/bin/python bench/packing_utilisation.py            # ~1 minute on 2 cores
    .venv/bin/python bench/packing_utilisation.py --seq 256 --steps 200 --json out.json

Tokenizes the embedded corpus (jaxtrain.data.load_default_corpus) in two cuts: "files" (the
demo's documents: whole modules, median ~2.5k tokens) and "definitions" (every module cut
before each top-level ``def``/``class``/decorator, median ~170 tokens, close to the median of
141 quoted in issue 12), and runs the real train loader (batch 8, seq 256) for each variant. "targets per slot" counts the
positions whose next label is a real target (what the loss learns from) over batch x seq;
"truncated tokens" were cut off documents longer than a row.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time

import numpy as np

from jaxtrain import TrainingArguments
from jaxtrain.data import IGNORE_INDEX, build_train_loader, load_default_corpus


def measure(name: str, args: TrainingArguments, data, steps: int) -> dict:
    loader = build_train_loader(args, data, pad_token_id=0)
    it = loader.batches(with_stats=True)
    targets = slots = truncated = 0
    start = time.perf_counter()
    for _ in range(steps):
        batch, stats = next(it)
        labels = batch["labels"].reshape(-1, batch["labels"].shape[-1])
        targets += int((labels[:, 1:] != IGNORE_INDEX).sum())
        slots += labels.size
        truncated += stats.num_truncated_tokens
    seconds = time.perf_counter() - start
    return {
        "variant": name,
        "targets_per_slot": targets / slots,
        "truncated_tokens": truncated,
        "rows_per_s": steps * args.total_batch_size / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json")
    opts = parser.parse_args()
    corpus = load_default_corpus()
    tok = corpus.tokenizer
    texts = corpus.train["text"]
    cuts = {
        "files": texts,
        "definitions": [d for t in texts for d in re.split(r"\n(?=(?:def|class|@) )", t)],
    }
    results = []
    for cut, docs in cuts.items():
        ids = tok([d for d in docs if d.strip()], add_special_tokens=False)["input_ids"]
        results += run(cut, [{"input_ids": x} for x in ids], opts)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


def run(cut: str, data: list[dict], opts: argparse.Namespace) -> list[dict]:
    lengths = np.array([len(x["input_ids"]) for x in data])
    print(f"\n{cut}: {len(lengths)} documents, median {np.median(lengths):.0f} tokens, "
          f"{(lengths > opts.seq).mean():.1%} longer than {opts.seq}")  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        base = dict(output_dir=out, total_batch_size=opts.batch, max_sequence_length=opts.seq,
                    max_steps=opts.steps, progress_bar="none", seed=0)  # fmt: skip
        variants = [
            ("one document per row (truncated)", dict(max_steps=-1)),
            ("packing, truncate long documents", dict(packing=True, split_long_documents=False)),
            ("packing, split long documents (default)", dict(packing=True)),
        ]
        rows = [measure(name, TrainingArguments(**(base | kw)), data, opts.steps)
                for name, kw in variants]  # fmt: skip
    print(
        f"| variant ({cut}) | targets per slot | truncated tokens | rows/s |\n| --- | --- | --- | --- |"
    )
    for r in rows:
        print(f"| {r['variant']} | {r['targets_per_slot']:.2%} | {r['truncated_tokens']} "
              f"| {r['rows_per_s']:.0f} |")  # fmt: skip
    for r in rows:
        r["corpus"] = cut
    return rows


if __name__ == "__main__":
    main()

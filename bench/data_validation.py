"""How long the up-front check of a whole map-style dataset takes (jaxtrain.data.scan).

    python bench/data_validation.py [--rounds N] [--seq 256]

On the embedded stdlib corpus, tokenized two ways: one row per document (`documents`, rows
of every length) and GPT-style chunks of `--seq` tokens (`chunks`). Reports rows, tokens
and the median and spread of `scan_tokens` over interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import datasets

from jaxtrain.data import chunk_dataset, load_default_corpus
from jaxtrain.data.scan import scan_tokens
from jaxtrain.data.sources import RandomAccessSource


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seq", type=int, default=256)
    options = parser.parse_args(argv)
    corpus = load_default_corpus()
    tokenizer = corpus.tokenizer
    documents = corpus.train.map(
        lambda batch: {"input_ids": tokenizer(batch["text"])["input_ids"]},
        batched=True,
        remove_columns=["text"],
    )
    cases = {
        "documents": documents,
        "chunks": chunk_dataset(corpus.train, tokenizer, options.seq),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    scans = {}
    for _ in range(options.rounds):
        for name, dataset in cases.items():  # interleaved, so load spikes hit both
            source = RandomAccessSource(dataset, name=name)
            start = time.perf_counter()
            scans[name] = scan_tokens(source, vocab_size=tokenizer.vocab_size, seq_len=options.seq)
            times[name].append(time.perf_counter() - start)
    print(f"datasets {datasets.__version__}, {options.rounds} rounds, seq {options.seq}")
    print("case | rows | tokens | median s | min s | max s | Mtokens/s")
    for name, scan in scans.items():
        t = times[name]
        median = statistics.median(t)
        print(
            f"{name} | {scan.rows} | {scan.tokens} | {median:.3f} | {min(t):.3f} | "
            f"{max(t):.3f} | {scan.tokens / median / 1e6:.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""lm-eval task evaluation time: jaxtrain's adapter (what a run does at each evaluation with
eval_tasks) against lm-eval's own Hugging Face backend (HFLM, transformers on torch), on the
same exported checkpoint and the same tasks, on this machine's CPU.

    .venv/bin/python bench/eval_tasks.py                 # ~6 minutes on 2 cores
    .venv/bin/python bench/eval_tasks.py --sizes demo --json out.json

For each model size a Llama is trained briefly on the embedded corpus (so generations end
at line ends, as a trained model's do) and exported; then both backends score the two example
tasks (python_mc: 160 log-likelihoods; python_em: 40 greedy generations of up to 16 tokens)
through one TaskSuite (the tasks loaded once, as during training), twice each:

- first: jaxtrain's includes compiling its scoring and engine steps (a run's first
  evaluation; later runs of the same shapes load them from the compilation cache);
- again: the next evaluation (every later evaluation of a run: nothing compiles).

HFLM runs at batch size 8 (jaxtrain's eval batch: 8 rows, 8 engine slots), torch on every
core. The scores of the two are checked equal before any time is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.data import chunk_dataset, load_default_corpus
from jaxtrain.evaluation.harness import TaskSuite
from jaxtrain.models import LlamaConfig, LlamaForCausalLM

SIZES = {  # name -> (hidden, layers, heads, kv heads)
    "demo": (128, 4, 2, 1),  # the demo's 1.3M-parameter model
    "S": (512, 6, 8, 4),
}


def trained_export(size: str, corpus, root: Path) -> Path:
    hidden, layers, heads, kv = SIZES[size]
    tok = corpus.tokenizer
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    args = TrainingArguments(output_dir=str(root / size), max_steps=150, learning_rate=3e-3,
                             warmup_steps=10, total_batch_size=16, max_sequence_length=256,
                             progress_bar="none", evaluation_strategy="no", save_final=False,
                             run_report=False)  # fmt: skip
    trainer = Trainer(arguments=args, model=model, processing_class=tok,
                      dataset_train=chunk_dataset(corpus.train, tok, 256))  # fmt: skip
    output = trainer.train()
    return trainer.save_pretrained(output.state, root / f"{size}-export")


def timed(suite: TaskSuite, lm) -> tuple[float, dict]:
    start = time.perf_counter()
    scores = suite.evaluate(lm)
    return time.perf_counter() - start, scores


def measure(size: str, export: Path) -> dict:
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from jaxtrain.evaluation.lm import JaxLM
    from jaxtrain.hf import AutoModelForCausalLM

    suite = TaskSuite(["python_mc", "python_em"])
    tokenizer = AutoTokenizer.from_pretrained(export)
    ours = JaxLM(AutoModelForCausalLM.from_pretrained(export), tokenizer, batch_size=8)
    theirs = HFLM(pretrained=str(export), device="cpu", batch_size=8)
    row = {"size": size, "parameters": sum(p.numel() for p in theirs.model.parameters())}
    row["jaxtrain_first_s"], scores = timed(suite, ours)
    row["jaxtrain_again_s"], _ = timed(suite, ours)
    row["hflm_first_s"], reference = timed(suite, theirs)
    row["hflm_again_s"], _ = timed(suite, theirs)
    for key in ("eval/python_mc/acc", "eval/python_em/exact_match"):
        if scores[key] != reference[key]:
            raise SystemExit(
                f"{size}: {key} differs: jaxtrain {scores[key]}, HFLM {reference[key]}"
            )
        row[key] = scores[key]
    row["speedup_again"] = row["hflm_again_s"] / row["jaxtrain_again_s"]
    row["speedup_first"] = row["hflm_first_s"] / row["jaxtrain_first_s"]
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="demo,S")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    corpus = load_default_corpus(vocab_size=4096)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes.split(","):
            rows.append(measure(size, trained_export(size, corpus, Path(root))))
            r = rows[-1]
            print(f"{size} ({r['parameters'] / 1e6:.1f}M): jaxtrain first {r['jaxtrain_first_s']:.1f}s "
                  f"again {r['jaxtrain_again_s']:.2f}s | HFLM first {r['hflm_first_s']:.1f}s again "
                  f"{r['hflm_again_s']:.2f}s | speedup {r['speedup_again']:.1f}x (again), "
                  f"{r['speedup_first']:.2f}x (first); acc {r['eval/python_mc/acc']:.3f}, "
                  f"exact match {r['eval/python_em/exact_match']:.3f}", flush=True)  # fmt: skip
    print(f"torch threads {torch.get_num_threads()}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Peak memory of the loss for a large vocabulary: whole-batch logits vs chunked log-probs.

    .venv/bin/python bench/chunked_loss.py                 # ~4 minutes on 2 cores
    .venv/bin/python bench/chunked_loss.py --rounds 1      # ~2 minutes
    .venv/bin/python bench/chunked_loss.py --vocab 151936 --rounds 1

A Llama (hidden 256, 2 layers, vocab 49152 by default) trains with the library's
``make_train_step`` (AdamW) on batch 8 x seq 512, in its own process per variant:

- ``full``: ``causal_lm_sums(model(input_ids), labels)``: float32 logits [8, 512, vocab];
- ``chunked``: the Trainer's default loss (``causal_lm_loss_sums``), which at this vocabulary
  computes the logits ``CHUNK_LOGITS // vocab`` positions at a time, each chunk's gradient
  formed in the forward pass (``training.logps.chunked_logp_sums``);
- ``dpo-full`` / ``dpo-chunked``: DPOTrainer's objective (``dpo_loss_sums``, sigmoid, a frozen
  reference copy) on 4 pairs x 512 (the same 8 rows, first 128 positions the prompt), with
  whole-batch logits or through ``training.logps.chunked_token_logps`` (chunk logits
  recomputed in the backward pass).

Reported per variant: XLA's temp buffer size of the compiled step (``memory_analysis``, exact),
the process's peak RSS (``ru_maxrss``) and the median step time of steps 2..N.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np


def worker(variant: str, vocab: int, steps: int) -> dict:
    import jax
    import optax
    from flax import nnx

    from jaxtrain.config.sections import RunSettings
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.state import TrainState
    from jaxtrain.trainers.dpo import DPOArguments, dpo_loss_sums
    from jaxtrain.trainers.frozen import TaskModel
    from jaxtrain.training.logps import pair_mask
    from jaxtrain.training.step import (
        causal_lm_loss_sums,
        causal_lm_sums,
        count_target_tokens,
        make_train_step,
    )

    def full(model, batch, rng):
        return causal_lm_sums(model(batch["input_ids"]), batch["labels"])

    dpo_loss = RunSettings.from_arguments(DPOArguments(output_dir="unused")).task

    def whole_logits(model):  # a plain callable, no hidden_states: whole-batch logits
        return lambda input_ids: model(input_ids)

    def dpo(model, batch, rng):
        policy, reference = model.model, model.reference
        if variant == "dpo-full":
            policy, reference = whole_logits(policy), whole_logits(reference)
        return dpo_loss_sums(policy, reference, batch, dpo_loss)

    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    is_dpo = variant.startswith("dpo")
    if is_dpo:
        model = TaskModel(model, reference=nnx.clone(model))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    del model
    optimizer = optax.adamw(3e-4)
    state = TrainState.create(params, optimizer)
    loss = {"full": full, "chunked": causal_lm_loss_sums}.get(variant, dpo)
    normalizer = (lambda b: pair_mask(b["labels"]).sum()) if is_dpo else count_target_tokens
    step = jax.jit(
        make_train_step(graphdef=graphdef, rest=rest, optimizer=optimizer,
                        schedule=optax.constant_schedule(3e-4), seed=0, loss_sums_fn=loss,
                        normalizer_fn=normalizer),
        donate_argnums=0,
    )  # fmt: skip
    ids = np.random.default_rng(1).integers(0, vocab, (1, 8, 512), dtype=np.int32)
    batch = {"input_ids": ids, "labels": ids}
    if is_dpo:
        labels = ids.copy()
        labels[..., :128] = -100  # the prompt
        mask = np.ones_like(ids)  # the pair layout names every side's attention mask
        batch = {"input_ids": ids[:, :4], "rejected_input_ids": ids[:, 4:],
                 "labels": labels[:, :4], "rejected_labels": labels[:, 4:],
                 "attention_mask": mask[:, :4], "rejected_attention_mask": mask[:, 4:]}  # fmt: skip
    compiled = step.lower(state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
        losses.append(float(metrics["loss_sum"]))
    return {
        "variant": variant,
        "temp_mb": temp / 2**20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.median(times[1:]),
        "loss_sum": losses[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker")
    opts = parser.parse_args()
    if opts.worker:
        print("RESULT " + json.dumps(worker(opts.worker, opts.vocab, opts.steps)))
        return
    variants = ("full", "chunked", "dpo-full", "dpo-chunked")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(opts.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            cmd = [sys.executable, __file__, "--worker", v, "--vocab", str(opts.vocab),
                   "--steps", str(opts.steps)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[v].append(
                json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
            )
    print(f"vocab {opts.vocab}, batch 8 x 512, hidden 256, 2 layers, {opts.rounds} rounds")
    print("| variant | XLA temp MB | peak RSS MB (median) | step s (median) | first loss sum |")
    print("| --- | --- | --- | --- | --- |")
    med = {}
    for v, rs in runs.items():
        med[v] = {
            k: statistics.median(r[k] for r in rs) for k in ("temp_mb", "peak_rss_mb", "step_s")
        }
        print(f"| {v} | {med[v]['temp_mb']:.0f} | {med[v]['peak_rss_mb']:.0f} | "
              f"{med[v]['step_s']:.2f} | {rs[0]['loss_sum']:.2f} |")  # fmt: skip
    print()
    for name, prefix in (("LM loss", ""), ("DPO", "dpo-")):
        c, f = med[prefix + "chunked"], med[prefix + "full"]
        print(f"{name} chunked / full: temp {c['temp_mb'] / f['temp_mb']:.2f}x, "
              f"peak RSS {c['peak_rss_mb'] / f['peak_rss_mb']:.2f}x, "
              f"step {c['step_s'] / f['step_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

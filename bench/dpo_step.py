"""Cost of a DPO step against an SFT step over the same chosen and rejected sequences.

    .venv/bin/python bench/dpo_step.py                       # S1, 4 rounds
    .venv/bin/python bench/dpo_step.py --rounds 6 --steps 10 --size S2

All variants run the library's `make_train_step` (AdamW) on the same jaxtrain Llama and the
same tokens, `pairs` chosen + `pairs` rejected rows of `seq` tokens, in one process, timed in
interleaved rounds (the order of the variants rotates every round):

- ``sft``: the base Trainer's causal LM loss over the 2 * pairs rows;
- ``dpo_frozen``: DPOTrainer's loss with a frozen reference model (a forward of the reference
  over the same rows, passed to the step as an argument);
- ``dpo_precomputed``: DPOTrainer's loss with reference log-probs stored in the batch.

Prints per variant the median step time and the median of per-round ratios to ``sft``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

SIZES = {  # hidden, intermediate, layers, heads, seq, pairs (bench/overhead.py S1 / S2)
    "S1": (256, 1024, 4, 4, 256, 4),
    "S2": (512, 2048, 8, 8, 512, 2),
}
VOCAB = 4096


def build(size: str):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain import Trainer, TrainingArguments
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.trainers import DPOArguments, DPOTrainer
    from jaxtrain.training.step import make_train_step

    hidden, inter, layers, heads, seq, pairs = SIZES[size]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(3, VOCAB, (2 * pairs, seq)).astype(np.int32)
    labels = ids.copy()
    labels[:, : seq // 4] = -100  # the prompt
    out_dir = tempfile.mkdtemp()
    common = dict(output_dir=out_dir, progress_bar="none", max_steps=100, learning_rate=1e-5)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    trainers = {
        "sft": Trainer(arguments=TrainingArguments(**common), model=model),
        "dpo_frozen": DPOTrainer(arguments=DPOArguments(**common), model=model),
        "dpo_precomputed": DPOTrainer(
            arguments=DPOArguments(**common, reference_free=True), model=model
        ),
    }
    sft_batch = {"input_ids": ids, "labels": labels}
    pair_batch = {
        "input_ids": ids[:pairs],
        "labels": labels[:pairs],
        "rejected_input_ids": ids[pairs:],
        "rejected_labels": labels[pairs:],
    }
    precomputed = {
        **pair_batch,
        "reference_chosen_logps": -np.full(pairs, 300.0, np.float32),
        "reference_rejected_logps": -np.full(pairs, 310.0, np.float32),
    }
    batches = {"sft": sft_batch, "dpo_frozen": pair_batch, "dpo_precomputed": precomputed}
    steps = {}
    for name, trainer in trainers.items():
        fn = make_train_step(
            graphdef=trainer.program.graphdef,
            optimizer=trainer.program.optimizer,
            schedule=trainer.program.schedule,
            seed=0,
            loss_sums_fn=trainer.program.objective.loss_sums,
            normalizer_fn=trainer.program.objective.normalizer,
        )
        batch = {k: jnp.asarray(v)[None] for k, v in batches[name].items()}  # [A=1, ...]
        frozen = trainer.program.frozen_state()
        step = jax.jit(fn, donate_argnums=0)
        state = trainer.create_state()
        state, metrics = step(state, batch, frozen)  # compile
        jax.block_until_ready(metrics)
        steps[name] = [step, state, batch, frozen]
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="S1", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    import jax

    steps = build(args.size)
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            step, state, batch, frozen = steps[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = step(state, batch, frozen)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / args.steps)
            steps[name][1] = state
    print(f"size {args.size}, {args.rounds} rounds x {args.steps} steps")
    for name in names:
        ratios = [t / s for t, s in zip(times[name], times["sft"])]
        print(
            f"{name:16s} median {statistics.median(times[name]) * 1e3:8.1f} ms/step "
            f"(min {min(times[name]) * 1e3:.1f}, max {max(times[name]) * 1e3:.1f}); "
            f"ratio to sft: median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()

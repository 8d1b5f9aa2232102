"""Preference steps: packed against padded DPO, and ORPO / SimPO against DPO.

    .venv/bin/python bench/pair_packing.py                 # both comparisons, 4 rounds
    .venv/bin/python bench/pair_packing.py --check         # a tiny shape, one round (make test)

Pairs of uneven length: prompt and response lengths drawn from log-normal distributions with
a long tail (medians 40 and 60 tokens, sigma 0.8; rows of 256 tokens), the shape of chat
preference sets, on random token ids (the ids do not change a step's time). Every variant is
the library's own compiled train step (`Program.compile_train_step`, AdamW) of the same
Llama, timed in interleaved rounds (the order rotates every round):

- ``padded``: DPO (frozen reference) on 8 pairs per step, each sequence padded to a row
  (16 rows of 256 tokens);
- ``packed``: DPO on the same 16 rows, the sequences of as many pairs as fit packed into them
  (`packing=True`: data/unit_packing.py); the pairs of a step are taken in order from the
  same stream;
- ``orpo``, ``simpo``: ORPO and SimPO (CPO, loss_type simpo, cpo_alpha 0) on the padded
  batch: no reference model.

Prints per variant the median step time, useful (non-padding) tokens per second and pairs per
second, and the per-device peak bytes XLA assigned to the step (arguments incl. the frozen
reference, outputs, temporaries), plus the host time of packing one step's rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import numpy as np

SHAPES = {  # hidden, intermediate, layers, heads, row tokens, padded pairs per step
    "B": (128, 512, 2, 4, 256, 8),
    "T": (32, 64, 1, 2, 64, 4),
}
VOCAB = 4096
MEDIANS, SIGMA = (40, 60), 0.8


def uneven_examples(n: int, row: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Featurized pairs (PairFeaturizer's form) of log-normal prompt/response lengths."""
    from jaxtrain.trainers.data import truncate_keep_response

    rng = np.random.default_rng(seed)
    scale = row / 256
    out = []
    for _ in range(n):
        prompt = rng.integers(
            3, VOCAB, max(1, int(rng.lognormal(np.log(MEDIANS[0] * scale), SIGMA)))
        )
        example = {}
        for side in ("chosen", "rejected"):
            length = max(2, int(rng.lognormal(np.log(MEDIANS[1] * scale), SIGMA)))
            response = rng.integers(3, VOCAB, length)
            p, c = truncate_keep_response(prompt.tolist(), response.tolist(), row)
            example[f"{side}_input_ids"] = np.asarray(p + c, np.int64)
            example[f"{side}_labels"] = np.asarray([-100] * len(p) + c, np.int64)
        out.append(example)
    return out


class Stream:
    def __init__(self, examples):
        self.examples, self.at = examples, 0

    def peek(self):
        return self.examples[self.at % len(self.examples)]

    def take(self):
        self.at += 1


def build(shape: str, steps: int):
    import jax
    from flax import nnx

    from jaxtrain.config.sections import RunSettings
    from jaxtrain.data.unit_packing import pack_units
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.observability.compiles import memory_summary
    from jaxtrain.runtime import Runtime
    from jaxtrain.trainers import CPOArguments, DPOArguments, ORPOArguments
    from jaxtrain.trainers.cpo import cpo_objective
    from jaxtrain.trainers.data import PairCollator
    from jaxtrain.trainers.dpo import dpo_objective
    from jaxtrain.trainers.frozen import TaskModel
    from jaxtrain.trainers.orpo import orpo_objective
    from jaxtrain.trainers.packed import PairLayout, units_per_micro_batch
    from jaxtrain.training.program import ModelParts, Program

    hidden, inter, layers, heads, row, pairs = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
    )
    common = dict(
        output_dir=tempfile.mkdtemp(),
        progress_bar="none",
        max_steps=100,
        learning_rate=1e-6,
        max_sequence_length=row,
        total_batch_size=pairs,
    )
    examples = uneven_examples(pairs * steps * 8, row)
    padded = [PairCollator(row)(examples[i * pairs : (i + 1) * pairs]) for i in range(steps)]
    rows = 2 * pairs  # the padded batch's rows: the same token slots
    stream, packed, pack_seconds = Stream(examples), [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch, _ = pack_units(
            stream,
            PairLayout(),
            rows=rows,
            seq_len=row,
            capacity=units_per_micro_batch(rows, row),
            pad_token_id=0,
        )
        pack_seconds.append(time.perf_counter() - start)
        packed.append(batch)

    def policy():
        return LlamaForCausalLM(config, rngs=nnx.Rngs(0))

    variants = {
        "padded": (DPOArguments(**common), dpo_objective, True, padded),
        "packed": (DPOArguments(**common, packing=True), dpo_objective, True, packed),
        "orpo": (ORPOArguments(**common), orpo_objective, False, padded),
        "simpo": (
            CPOArguments(**common, loss_type="simpo", cpo_alpha=0.0, beta=2.0),
            cpo_objective,
            False,
            padded,
        ),
    }
    built = {}
    for name, (args, objective, reference, batches) in variants.items():
        model = TaskModel(policy(), reference=policy() if reference else None)
        runtime = Runtime.from_arguments(args, jax.devices()[:1])
        settings = RunSettings.from_arguments(args)
        parts = ModelParts.adopt(model, settings.model)
        program = Program(
            parts, runtime, settings, schedule_length=100, objective=objective(settings)
        )
        batches = [{k: jax.numpy.asarray(v)[None] for k, v in b.items()} for b in batches]
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batches[0].items()}
        step = program.compile_train_step(program.abstract_state(), abstract)
        state = program.create_state()
        useful = [float(b["attention_mask"].sum()) for b in batches]
        units = [float(b["pair_mask"].sum()) if "pair_mask" in b else pairs for b in batches]
        if "rejected_attention_mask" in batches[0]:
            useful = [
                u + float(b["rejected_attention_mask"].sum()) for u, b in zip(useful, batches)
            ]
        memory = memory_summary(step.compiled.executable) or {}
        built[name] = {
            "step": step,
            "state": state,
            "batches": batches,
            "useful": sum(useful) / len(useful),
            "pairs": sum(units) / len(units),
            "peak": memory.get("peak", float("nan")),
            "slots": batches[0]["input_ids"].size
            + (batches[0]["rejected_input_ids"].size if "rejected_input_ids" in batches[0] else 0),
        }
    return built, statistics.median(pack_seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="tiny shape, one round")
    args = parser.parse_args()
    shape = "T" if args.check else "B"
    rounds = 1 if args.check else args.rounds
    import jax

    built, pack_s = build(shape, args.steps)
    names = list(built)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            entry = built[name]
            start = time.perf_counter()
            for batch in entry["batches"]:
                entry["state"], metrics = entry["step"](entry["state"], batch)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / len(entry["batches"]))
    print(f"shape {shape} {SHAPES[shape]}, {rounds} rounds x {args.steps} steps; packing one "
          f"step's rows on the host: {pack_s * 1e3:.1f} ms")  # fmt: skip
    for name in names:
        entry, median = built[name], statistics.median(times[name])
        print(
            f"{name:7s} {median * 1e3:8.1f} ms/step  useful {entry['useful'] / median:9.0f} "
            f"tokens/s ({entry['useful'] / entry['slots']:.0%} of {entry['slots']} token "
            f"slots)  {entry['pairs'] / median:7.1f} pairs/s  peak {entry['peak'] / 2**20:.1f} MiB"
        )
    base = statistics.median(times["padded"])
    packed = built["packed"]["useful"] / statistics.median(times["packed"])
    print(f"packed / padded useful tokens/s: {packed / (built['padded']['useful'] / base):.2f}x")
    for name in ("orpo", "simpo"):
        ratio = statistics.median(times[name]) / base
        peak = built[name]["peak"] / built["padded"]["peak"]
        print(f"{name} / dpo: step time {ratio:.2f}x, peak memory {peak:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""QLoRA's costs and quality: the base's bytes, a ~1B LoRA step's peak RSS with an NF4 base
against a bf16 one, and the eval loss of NF4-QLoRA against bf16-LoRA on the demo corpus.

    PYTHONPATH=. .venv/bin/python bench/qlora.py bytes
    PYTHONPATH=. .venv/bin/python bench/qlora.py rss [--repeats 2] [--shape h1024] [--scan]
    PYTHONPATH=. .venv/bin/python bench/qlora.py quality [--steps 200]

rss: a Llama of hidden 2048, 16 layers (1.2B parameters with its 32k vocabulary; `--shape h1024`:
hidden 1024, 8 layers), each base in its own process (`--scan`: also both under scan_layers, where
an NF4 base is dequantized one layer at a time), written once
as a bf16 Hugging Face directory (a temporary one, 2.4 GB), then in each worker loaded as a user
would (`AutoModelForCausalLM.from_pretrained(dir, param_dtype=bfloat16)`, with
`quantization="nf4"` for the NF4 base: each kernel quantized as it is read) and LoRA-tuned:
rank 16 on every projection, remat nothing_saveable, one row of 256 tokens, 3 steps. Peak RSS
is the worker's ru_maxrss, read after the load and after the steps, and the peak of its
anonymous memory (RssAnon sampled every 20 ms: ru_maxrss also counts the read pages of the
memory-mapped safetensors file, which the kernel may drop).
quality: a 4-layer Llama pretrained in float on the demo corpus, then LoRA-tuned for `--steps`
steps on a held-out split, once on a bf16 base and once on an NF4 base, from the same start.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULT = "QLORA_RESULT "
SHAPES = {
    "1.2b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=4),
    "h1024": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4),
}  # fmt: skip


def lora_args(out: str, **kw):
    from jaxtrain import TrainingArguments

    base = dict(output_dir=out, lora_rank=16, lora_alpha=32, learning_rate=1e-3,
                progress_bar="none", run_report=False, evaluation_strategy="no",
                save_final=False, logging_steps=1)  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def bytes_stage() -> dict:
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.config.sections import ModelSettings
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.parallel import ModelFactory
    from jaxtrain.quantization import quantized_bytes
    from jaxtrain.training.program import ModelParts

    out = {}
    for kind, double in (("nf4", False), ("nf4", True), ("int8", False)):
        args = lora_args("unused", quantization=kind, quantization_double=double)
        factory = ModelFactory(lambda: LlamaForCausalLM(LlamaConfig(**SHAPES["1.2b"]), dtype=jnp.bfloat16,
                                                        param_dtype=jnp.bfloat16,
                                                        rngs=nnx.Rngs(0)))  # fmt: skip
        parts = ModelParts.adopt(factory, ModelSettings.from_arguments(args))  # shapes only
        stored, bf16 = quantized_bytes(parts.model)
        out[f"{kind}{'+double' if double else ''}"] = stored / bf16
    return out


def write_base(directory: str, shape: str = "1.2b") -> None:
    """A Llama of SHAPES[shape] (random weights) as a bf16 HF directory."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.hf import save_pretrained
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]), param_dtype=jnp.bfloat16,
                             rngs=nnx.Rngs(0))  # fmt: skip
    save_pretrained(model, directory)


class AnonPeak:
    """The peak of the process's anonymous resident memory (RssAnon), sampled every 20 ms.
    ru_maxrss also counts the pages of the memory-mapped safetensors file that were read
    (file-backed, the kernel's to drop), which is most of a float base's size."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def read(self) -> float:
        self.peak = max(self.peak, self.now())
        return self.peak / 2**30


def rss_worker(kind: str, base: str) -> dict:
    import jax.numpy as jnp

    anon = AnonPeak()

    from jaxtrain import Trainer
    from jaxtrain.hf import AutoModelForCausalLM

    rows = [{"input_ids": np.arange(256) % 31999 + 1} for _ in range(8)]
    stored, _, scan = kind.partition("+")  # "nf4+scan": an NF4 base, layers under scan
    quantization = None if stored == "bf16" else stored
    args = lora_args(tempfile.mkdtemp(), quantization=quantization, max_steps=3,
                     total_batch_size=1, max_sequence_length=256, param_dtype="bfloat16",
                     dtype="bfloat16", gradient_checkpointing="nothing_saveable",
                     scan_layers=scan == "scan")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, quantization=quantization
    )
    load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    load_anon = anon.read()
    times = []

    class Clock:
        def on_step_end(self, trainer, state, metrics, step):
            import jax

            jax.block_until_ready(state)
            times.append(time.perf_counter())

    Trainer(arguments=args, model=model, dataset_train=rows, callbacks=[Clock()]).train()
    return {
        "kind": kind,
        "load_rss_gib": load_rss,
        "load_anon_gib": load_anon,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_anon_gib": anon.read(),
        "step_s": statistics.median(np.diff(times)) if len(times) > 1 else None,
    }


def quality_stage(steps: int) -> dict:
    from flax import nnx

    from jaxtrain import Trainer, TrainingArguments
    from jaxtrain.data import chunk_dataset, load_default_corpus
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    corpus = load_default_corpus(vocab_size=4096)
    train = chunk_dataset(corpus.train, corpus.tokenizer, seq_len=128)
    evaluation = chunk_dataset(corpus.eval, corpus.tokenizer, seq_len=128)
    half = len(evaluation) // 2
    tune, held_out = evaluation.select(range(half)), evaluation.select(range(half, len(evaluation)))
    config = LlamaConfig(vocab_size=len(corpus.tokenizer), hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    pre = Trainer(
        arguments=TrainingArguments(
            output_dir=tempfile.mkdtemp(),
            max_steps=300,
            total_batch_size=16,
            max_sequence_length=128,
            learning_rate=2e-3,
            warmup_steps=30,
            progress_bar="none",
            run_report=False,
            evaluation_strategy="no",
            save_final=False,
        ),  # fmt: skip
        model=LlamaForCausalLM(config, rngs=nnx.Rngs(0)),
        dataset_train=train,
    )
    state = pre.train().state
    out = {}
    for kind in (None, "nf4"):
        model = pre.model_from_state(state)
        args = lora_args(tempfile.mkdtemp(), quantization=kind, max_steps=steps,
                         total_batch_size=16, max_sequence_length=128,
                         param_dtype="bfloat16" if kind is None else None,
                         evaluation_strategy="steps", eval_steps=steps, max_eval_batches=20)  # fmt: skip
        trainer = Trainer(arguments=args, model=nnx.clone(model), dataset_train=tune,
                          dataset_eval=held_out)  # fmt: skip
        out["bf16" if kind is None else kind] = trainer.train().metrics["eval/loss"]
    out["nf4_vs_bf16"] = out["nf4"] / out["bf16"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("bytes", "rss", "quality", "worker"))
    parser.add_argument("--kind", default="nf4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--base", help="worker: the HF directory to load")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.2b", help="rss: the model")
    parser.add_argument("--scan", action="store_true", help="rss: also both bases under scan")
    opts = parser.parse_args()
    if opts.stage == "worker":
        print(RESULT + json.dumps(rss_worker(opts.kind, opts.base)))
    elif opts.stage == "bytes":
        print(json.dumps(bytes_stage(), indent=1))
    elif opts.stage == "quality":
        print(json.dumps(quality_stage(opts.steps), indent=1))
    else:
        kinds = ["bf16", "nf4"] + (["bf16+scan", "nf4+scan"] if opts.scan else [])
        found: dict[str, list] = {kind: [] for kind in kinds}
        base = tempfile.mkdtemp()
        done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                               f"import qlora; qlora.write_base({base!r}, {opts.shape!r})"], capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        for repeat in range(opts.repeats):
            for kind in kinds if repeat % 2 == 0 else kinds[::-1]:
                done = subprocess.run([sys.executable, __file__, "worker", "--kind", kind, "--base", base],
                                      capture_output=True, text=True, timeout=3600)  # fmt: skip
                line = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
                if not line:
                    raise SystemExit(done.stderr[-3000:])
                found[kind].append(json.loads(line[0][len(RESULT) :]))
        shutil.rmtree(base)
        for kind, runs in found.items():
            print(kind, "peak RSS after the load", [round(r["load_rss_gib"], 2) for r in runs],
                  "GiB, anonymous", [round(r["load_anon_gib"], 2) for r in runs],
                  "GiB; after the steps", [round(r["peak_rss_gib"], 2) for r in runs],
                  "GiB, anonymous", [round(r["peak_anon_gib"], 2) for r in runs],
                  "GiB; step s", [round(r["step_s"] or 0, 1) for r in runs])  # fmt: skip
        for key, what in (("peak_rss_gib", "peak RSS"), ("peak_anon_gib", "peak anonymous RSS"),
                          ("load_anon_gib", "anonymous RSS after the load")):  # fmt: skip
            for kind in kinds[1:]:
                ratio = statistics.median(r[key] for r in found[kind]) / statistics.median(
                    r[key] for r in found["bf16"]
                )
                print(f"{kind} / bf16 {what}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

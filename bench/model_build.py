"""How long building a model eagerly takes on the CPU, and how many programs it compiles: the
first build of each family in a fresh process (its draws compile then), medians of the rounds.

    python bench/model_build.py --rounds 3

Against another checkout (the same command with PYTHONPATH set to it) this compares two
versions of jaxtrain/models/initial_values.py, the eager parameter draws.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# name -> (class path, config class path, config fields): sizes a laptop builds in a second.
FAMILIES = {
    "llama 6.3M": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2)),
    "mixtral 8 experts": ("MoeForCausalLM", "MoeConfig", dict(
        vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=4)),
}  # fmt: skip

CHILD = """
import json, sys, time
import jax
from flax import nnx
import jaxtrain.models as models
import jaxtrain.models.gpt2 as gpt2
programs = [0]
def count(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        programs[0] += 1
jax.monitoring.register_event_duration_secs_listener(count)
model_class, config_class, fields = json.loads(sys.argv[1])
where = gpt2 if model_class.startswith("GPT2") else models
start = time.perf_counter()
model = getattr(where, model_class)(getattr(where, config_class)(**fields), rngs=nnx.Rngs(0))
jax.block_until_ready(nnx.state(model))
print(json.dumps({"seconds": time.perf_counter() - start, "programs": programs[0],
                  "jaxtrain": models.__file__}))
"""


def build_once(spec: tuple) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
        env={"JAX_PLATFORMS": "cpu", **os.environ},
        cwd=tempfile.gettempdir(),  # not a checkout: PYTHONPATH's (or the installed) jaxtrain
    )
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    results: dict[str, list[dict]] = {name: [] for name in FAMILIES}
    for _ in range(rounds):  # interleaved: each round builds every family once
        for name, spec in FAMILIES.items():
            results[name].append(build_once(spec))
    print("jaxtrain:", results[next(iter(results))][0]["jaxtrain"].rsplit("/models/", 1)[0])
    for name, runs in results.items():
        seconds = [r["seconds"] for r in runs]
        print(
            f"{name:18s} build {statistics.median(seconds):.2f} s "
            f"({min(seconds):.2f}-{max(seconds):.2f}), {runs[0]['programs']} programs"
        )


if __name__ == "__main__":
    main()

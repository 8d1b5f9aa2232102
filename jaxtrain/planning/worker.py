"""The child process of `jaxtrain plan`: `python -m jaxtrain.planning.worker SPEC OUT`.

It is started with XLA_FLAGS=--xla_force_host_platform_device_count=N (the target's device
count, as CPU devices), takes the target's own compiler where there is one (targets.py:
XLA:TPU for a TPU topology, XLA:GPU with the CUDA plugin and a GPU), else those CPU
devices, compiles the train step for each mesh of SPEC (and each of its `choices`: argument
overrides, planning/choices.py) and writes their figures (or the reason a mesh cannot run),
each naming its compiler, to OUT as JSON.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import sys
from typing import Any


def plan_meshes(spec: dict[str, Any]) -> list[dict[str, Any]]:
    from jaxtrain.errors import JaxtrainError
    from jaxtrain.planning.choices import AS_CONFIGURED
    from jaxtrain.planning.program import build_config, plan_program
    from jaxtrain.planning.targets import STAND_INS, compile_target
    from jaxtrain.tasks import DEFAULT_TASK, get_task

    config = build_config(spec["model"])
    task = spec.get("task", DEFAULT_TASK)
    arguments_class = get_task(task).arguments
    base = arguments_class.from_dict(spec["arguments"], source="the plan's arguments")
    target, devices = compile_target(spec)
    attention = spec.get("attention")
    if target.compiler != "XLA:GPU":
        attention = STAND_INS.get(attention, attention)
    results = []
    for dims, (choice, overrides) in itertools.product(
        spec["meshes"], spec.get("choices", [(AS_CONFIGURED, {})])
    ):
        args = dataclasses.replace(base, sharding_axis_dims=tuple(dims), **overrides)
        named = {"mesh": list(dims), "choice": choice, "compiler": target.to_json()}
        try:
            figures = plan_program(
                config,
                args,
                devices,
                layers=spec["layers"],
                attention=attention,
                task=task,
            )
        except JaxtrainError as err:  # this mesh cannot run the model: say why, try the next
            results.append({**named, "error": str(err)})
            continue
        except Exception as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            # XLA:TPU refuses a program whose buffers exceed the chip's memory: it does not fit.
            reason = " ".join(str(err).split())[:300]
            results.append({**named, "error": f"does not fit: {reason}"})
            continue
        results.append({**named, "figures": figures})
        print(f"planned mesh {dims} ({choice}): {figures['method']}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str]) -> int:
    # `jaxtrain plan` starts this process in a session of its own and kills it on Ctrl-C; a
    # SIGINT sent here directly ends it quietly too (the parent reports the exit code).
    signal.signal(signal.SIGINT, lambda number, frame: os._exit(128 + number))
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    results = plan_meshes(spec)
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

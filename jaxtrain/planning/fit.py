"""Settings that would fit a train step that ran out of device memory.

Each is one change to the run, compiled by the run's own compiler for its own devices and
read for its peak per device (program.plan_program: XLA's memory analysis), against the
bytes that were free for the step (on XLA:CPU with the next step's temporaries counted
too: it allocates them while a step runs). Three knobs, each with as few compiles as it takes:

- gradient_checkpointing: the policy that keeps the least (nothing_saveable), one compile;
- fsdp: the data-parallel devices moved into fsdp (the state is split over them too),
  one compile, when the mesh has data-parallel devices;
- the micro-batch: gradient_accumulation_steps raised (the same total batch and the same
  updates). Memory per device is close to linear in the micro-batch's rows, a + b * rows:
  the failed step and one compile at the next accumulation give a and b, the largest
  micro-batch under the budget follows, and its compile checks it (twice at most).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxtrain.errors import OutOfMemoryError
from jaxtrain.parallel.mesh import BATCH_AXES, MESH_AXES

STRONGEST_REMAT = "nothing_saveable"


def _mib(value: float | None) -> str:
    if value is None:
        return "out of memory when compiled"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def fitting_settings(
    args: Any,
    mesh_shape: dict[str, int],
    budget: float,
    current_peak: float,
    compile_peak: Callable[[Any], float | None],
    show: Callable[[float | None], str] = _mib,
) -> list[str]:
    """One phrase per knob: "setting=value (peak)" when it fits `budget` bytes per device,
    "not ..." with what it would need when it does not. `compile_peak(arguments)` is the
    peak per device of the run's step compiled with those arguments (None: the compile
    itself ran out of memory); `show` writes a figure."""
    return [
        _remat(args, budget, compile_peak, show),
        _fsdp(args, mesh_shape, budget, compile_peak, show),
        _accumulation(args, mesh_shape, budget, current_peak, compile_peak, show),
    ]


def _fits(peak: float | None, budget: float) -> bool:
    return peak is not None and peak <= budget


def _remat(args: Any, budget: float, compile_peak: Callable, show: Callable) -> str:
    if args.gradient_checkpointing == STRONGEST_REMAT:
        return f"gradient_checkpointing is {STRONGEST_REMAT} already"
    peak = compile_peak(dataclasses.replace(args, gradient_checkpointing=STRONGEST_REMAT))
    setting = f"gradient_checkpointing={STRONGEST_REMAT}"
    return f"{setting} ({show(peak)})" if _fits(peak, budget) else f"not {setting} ({show(peak)})"


def _fsdp(
    args: Any,
    mesh_shape: dict[str, int],
    budget: float,
    compile_peak: Callable,
    show: Callable,
) -> str:
    dims = [int(mesh_shape.get(axis, 1)) for axis in MESH_AXES]
    if dims[0] == 1:
        return f"more fsdp: no data-parallel devices to move (dp=1, fsdp={dims[1]})"
    dims = [1, dims[0] * dims[1], *dims[2:]]
    peak = compile_peak(dataclasses.replace(args, sharding_axis_dims=dims))
    setting = f"sharding_axis_dims={dims}"
    return f"{setting} ({show(peak)})" if _fits(peak, budget) else f"not {setting} ({show(peak)})"


def _accumulation(
    args: Any,
    mesh_shape: dict[str, int],
    budget: float,
    current_peak: float,
    compile_peak: Callable,
    show: Callable,
) -> str:
    total, steps = args.total_batch_size, args.gradient_accumulation_steps
    shards = 1
    for axis in BATCH_AXES:
        shards *= int(mesh_shape.get(axis, 1))
    # Accumulations that keep the total batch whole and split each micro-batch over the
    # batch shards, fewest first.
    options = [
        g for g in range(steps + 1, total + 1) if total % g == 0 and (total // g) % shards == 0
    ]
    if not options:
        return f"no more gradient_accumulation_steps: the micro-batch of {args.micro_batch_size} rows is one per batch shard already"

    def phrase(g: int, peak: float | None) -> str:
        setting = f"gradient_accumulation_steps={g} (micro-batch {total // g}, {show(peak)})"
        return setting if _fits(peak, budget) else f"not {setting}"

    rows, first = total // steps, options[0]
    peak = compile_peak(dataclasses.replace(args, gradient_accumulation_steps=first))
    if _fits(peak, budget) or peak is None:
        return phrase(first, peak)
    per_row = (current_peak - peak) / (rows - total // first)
    if per_row <= 0:
        return phrase(first, peak) + " (a smaller micro-batch does not lower the peak)"
    base = peak - per_row * (total // first)
    tried = phrase(first, peak)
    for _ in range(2):
        most_rows = (budget - base) / per_row
        chosen = next((g for g in options if total // g <= most_rows), None)
        if chosen is None or total // chosen >= total // first:
            return tried if chosen is None else phrase(chosen, peak)
        peak = compile_peak(dataclasses.replace(args, gradient_accumulation_steps=chosen))
        tried = phrase(chosen, peak)
        if _fits(peak, budget):
            return tried
        options = [g for g in options if g > chosen]
        if not options or peak is None:
            return tried
    return tried


def search_fits(
    err: OutOfMemoryError,
    config: Any,
    args: Any,
    devices: list[Any],
    mesh_shape: dict[str, int],
    attention: str | None = None,
) -> OutOfMemoryError:
    """`err` naming the settings that would fit (when the step's figures are known).

    On an accelerator the run's own process compiles (the device's memory is full, not the
    host's). On XLA:CPU the device memory is this process's: what refused the step (a
    process limit, the machine's memory) would refuse the compiles too, so a child process
    with as many CPU devices compiles them, in an address space of its own, as
    `jaxtrain plan` does."""
    if err.needed_bytes is None or err.free_bytes is None:
        return err
    # XLA:CPU holds two steps' temporaries at once (training/out_of_memory.py): a setting
    # fits there when its peak plus one more step's temporaries does.
    in_flight = 2 if devices[0].platform == "cpu" else 1
    current = err.needed_bytes + (in_flight - 1) * (err.temporaries_bytes or 0.0)
    if devices[0].platform == "cpu":
        from jaxtrain.planning.child import run_child

        spec = {
            "model": config.to_dict(),
            "arguments": _child_arguments(args),
            "devices": len(devices),
            "mesh": mesh_shape,
            "budget": err.free_bytes,
            "current_peak": current,
            "attention": attention,
            "in_flight": in_flight,
        }
        fits = run_child("jaxtrain.planning.fit", spec, len(devices), label="jaxtrain train")
        return err.with_fits(fits)
    compile_peak = _compiler(_plan_config(config), devices, attention, in_flight)
    return err.with_fits(fitting_settings(args, mesh_shape, err.free_bytes, current, compile_peak))


def _child_arguments(args: Any) -> dict[str, Any]:
    values = {**args.to_dict(), "compilation_cache_dir": None, "report_to": ["jsonl"]}
    values["max_steps"] = args.max_steps if args.max_steps > 0 else 1000
    return values


def _plan_config(config: Any) -> Any:
    if getattr(config, "pad_token_id", 0) is None:  # as plan's build_config: same program
        config = dataclasses.replace(config, pad_token_id=0)
    return config


def _compiler(config: Any, devices: list[Any], attention: str | None, in_flight: int = 1):
    from jaxtrain.planning.program import plan_program
    from jaxtrain.training.out_of_memory import is_out_of_memory

    def compile_peak(arguments: Any) -> float | None:
        try:
            figures = plan_program(config, arguments, devices, attention=attention)
        except Exception as failure:
            if is_out_of_memory(failure):  # XLA:TPU refuses a program that does not fit
                return None
            raise
        extra = (in_flight - 1) * figures["memory"]["temporaries"]
        return float(figures["peak_bytes"] + extra)

    return compile_peak


def main(argv: list[str]) -> int:
    """The child of `search_fits` on a CPU: `python -m jaxtrain.planning.fit SPEC OUT`."""
    import json

    import jax

    from jaxtrain.arguments import TrainingArguments
    from jaxtrain.planning.program import build_config

    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    args = TrainingArguments.from_dict(spec["arguments"], source="the run's arguments")
    devices = jax.devices()[: spec["devices"]]
    config = build_config(spec["model"])
    compile_peak = _compiler(config, devices, spec.get("attention"), spec.get("in_flight", 1))
    fits = fitting_settings(args, spec["mesh"], spec["budget"], spec["current_peak"], compile_peak)
    with open(out_path, "w") as f:
        json.dump(fits, f)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

"""`jaxtrain plan`: compile the run's train step for a target cluster and predict the step.

    jaxtrain plan [CONFIG.yaml] [--hf_config config.json] --devices 256 --accelerator h100
                  [--processes 32] [--sweep | --choices] [--layers auto|all|unit]
                  [--output plan.json]
                  [--field value ...]
    jaxtrain plan ... --accelerator v5e|v5p|v6e --topology 2x4   (a TPU slice's chips)

The run's own arguments (mesh, batch, sequence, dtype, remat, optimizer, accumulation) come
from the config and flags as for `jaxtrain train`. The compile runs in a child process
(jaxtrain/planning/worker.py) by the target's own compiler where this machine has one
(XLA:TPU with the `tpu` extra, XLA:GPU with the CUDA plugin and a GPU), else by XLA:CPU
for that many virtual devices (planning/targets.py; `--compiler cpu` asks for it); the
plan says which. Nothing is allocated, nothing trained. `--sweep` compiles every mesh of the
devices; `--choices` the run's mesh with scan_layers, mu_dtype and fp8_matmuls each changed
alone (planning/choices.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxtrain.config.parallel_checks import rollout_split
from jaxtrain.errors import ArgumentError
from jaxtrain.planning.targets import CPU_BOUND_NOTE, STAND_INS

PLAN_OPTIONS = {
    "hf_config": None,
    "devices": None,
    "accelerator": "h100",
    "processes": None,
    "layers": "auto",
    "output": None,  # default: <output_dir>/plan.json when the command names one, else ./
    "topology": None,
    "compiler": "auto",
}
PLAN_FLAGS = ("sweep", "choices")
# Attention kernels XLA:CPU cannot lower, and what the plan compiles in their place.
CPU_STAND_INS = STAND_INS


def split_plan_options(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(plan options, the rest for the run's config)."""
    options: dict[str, Any] = dict(PLAN_OPTIONS)
    options.update(dict.fromkeys(PLAN_FLAGS, False))
    rest: list[str] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        key, _, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if key in PLAN_FLAGS:
            options[key] = True
        elif key in PLAN_OPTIONS:
            if not inline:
                if index + 1 >= len(tokens):
                    raise ArgumentError(f"--{key} needs a value.")
                index += 1
                inline = tokens[index]
            options[key] = inline
        else:
            rest.append(token)
        index += 1
    return options, rest


def _positive_int(options: dict[str, Any], key: str) -> int | None:
    value = options[key]
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ArgumentError(f"--{key} must be a positive integer, got {value!r}.")
    return number


def data_vocab_size(data: dict[str, Any]) -> int | None:
    """The vocabulary `jaxtrain train` gives a model section without its own: the data's
    tokenizer's (`data.tokenizer`, else the embedded corpus's BPE of `data.vocab_size`
    tokens, not trained here); None for token ids without a tokenizer."""
    if data.get("tokenizer"):
        from jaxtrain.cli.run_dir import data_tokenizer

        return len(data_tokenizer(data["tokenizer"]))
    if data.get("source", "default") == "default" and "mixture" not in data:
        return int(data.get("vocab_size", 4096))
    return None


def model_spec(
    options: dict[str, Any], model_section: dict[str, Any], data: dict[str, Any]
) -> dict[str, Any]:
    """{"hf_config": ...} from --hf_config or model.pretrained's config.json, else the
    jaxtrain model section (its vocab_size, unless set, the data's tokenizer's)."""
    path = options["hf_config"]
    if path is None and "pretrained" in model_section:
        path = str(Path(model_section["pretrained"]) / "config.json")
    if path is not None:
        try:
            hf = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ArgumentError(f"--hf_config {path}: cannot read it as JSON ({err}).") from None
        if not isinstance(hf, dict):
            raise ArgumentError(f"--hf_config {path}: expected a JSON object (a config.json).")
        return {"hf_config": hf, "source": path}
    spec = dict(model_section)
    spec.pop("base_model", None)
    if "vocab_size" not in spec and (vocab := data_vocab_size(data)) is not None:
        spec["vocab_size"] = vocab
    return spec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sweep_meshes(devices: int, per_node: int, micro_batch: int, config: Any) -> list[list[int]]:
    """(dp, fsdp, ep, tp, 1) meshes over `devices`: tp within a node and dividing the heads,
    ep (mixture-of-experts models) dividing the experts, dp x fsdp dividing the micro-batch;
    dp and tp are powers of two or the whole count."""
    heads = int(getattr(config, "num_attention_heads", 1))
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    experts = int(getattr(config, "num_experts", 0) or 0)
    meshes = []
    for tp in _divisors(min(devices, per_node)):
        if heads % tp or kv % tp or (tp & (tp - 1)):
            continue
        for ep in _divisors(devices // tp) if experts else [1]:
            if experts and (experts % ep or ep > per_node):
                continue
            rest = devices // (tp * ep)
            for dp in _divisors(rest):
                fsdp = rest // dp
                if (dp & (dp - 1)) and dp != rest or micro_batch % (dp * fsdp):
                    continue
                meshes.append([dp, fsdp, ep, tp, 1])
    return meshes


def plan_path(options: dict[str, Any], args: Any, sources: dict[str, str]) -> Path:
    """Where plan.json goes: --output, else the output_dir the command names (a flag or the
    config file; the demo's runs/demo is not named), else the current directory."""
    from jaxtrain.cli.run_config import DEMO

    if options["output"] is not None:
        return Path(options["output"])
    if sources.get("output_dir") not in (None, DEMO, "default"):
        return Path(args.output_dir) / "plan.json"
    return Path("plan.json")


def run_worker(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The worker's results, computed in a child process with spec["devices"] CPU devices."""
    from jaxtrain.planning.child import run_child

    return run_child("jaxtrain.planning.worker", spec, spec["devices"], label="jaxtrain plan")


def compiled_attention(compiler: dict[str, Any] | None, attention: str | None) -> str | None:
    """The attention the step was compiled with: the run's, unless only XLA:GPU has it."""
    if compiler is not None and compiler["compiler"] == "XLA:GPU":
        return attention
    return STAND_INS.get(attention, attention)


def compiler_line(compiler: dict[str, Any], accel_name: str, attention: str | None) -> str:
    """Which compiler the figures come from, and so what "per device" and "fits" mean."""
    if compiler["compiler"] != "XLA:CPU":
        line = (
            f"compiled by {compiler['compiler']} for {compiler['description']}, deviceless: "
            f"'per device' and the verdict are that compiler's own buffer assignment"
        )
    else:
        line = (
            f"compiled by XLA:CPU on {compiler['description']} ({compiler['fallback_reason']}): "
            f"'per device' and the verdict use its figure; {CPU_BOUND_NOTE}"
        )
    stand_in = compiled_attention(compiler, attention)
    if stand_in != attention:
        line += (
            f"; attention {attention!r} has no {compiler['compiler']} kernel: compiled with "
            f"{stand_in!r} (no T x T array either; on one H100 the 1B campaign measured its "
            "peak 18% above cudnn's, bench/RESULTS.md)"
        )
    return line


def cmd_plan(tokens: list[str]) -> int:
    from jaxtrain.cli.run_config import (
        explain_source,
        parse_overrides,
        resolve_config_with_sources,
        split_config,
    )
    from jaxtrain.cli.usage import split_positional
    from jaxtrain.planning.accelerators import accelerator, accelerator_key
    from jaxtrain.planning.choices import AS_CONFIGURED, choices, choices_table
    from jaxtrain.planning.program import build_config
    from jaxtrain.planning.report import details, ranked, table
    from jaxtrain.planning.roofline import estimate
    from jaxtrain.planning.targets import TPU_GENERATIONS, topology_chips
    from jaxtrain.tasks import DEFAULT_TASK

    options, rest = split_plan_options(tokens)
    accel = accelerator(options["accelerator"])
    key = accelerator_key(options["accelerator"])
    if options["compiler"] not in ("auto", "cpu"):
        raise ArgumentError(f"--compiler must be auto or cpu, got {options['compiler']!r}.")
    chips = None
    if key in TPU_GENERATIONS:
        if options["topology"] is None:
            raise ArgumentError(
                f"--accelerator {key} plans a TPU slice: give its chips with --topology "
                f"(e.g. --topology {'2x2x2' if key == 'v5p' else '2x4'} for 8 chips)."
            )
        chips = topology_chips(key, options["topology"])
        if options["devices"] is not None and _positive_int(options, "devices") != chips:
            raise ArgumentError(
                f"--devices {options['devices']} disagrees with --topology "
                f"{options['topology']} ({chips} chips): drop --devices."
            )
        options["devices"] = str(chips)
    elif options["topology"] is not None:
        raise ArgumentError(
            f"--topology describes a TPU slice (v5e, v5p, v6e); --accelerator {key} takes "
            "--devices."
        )
    path, rest = split_positional(rest)
    config, sources = resolve_config_with_sources(path, parse_overrides(rest))
    try:
        args, model_section, data, _ = split_config(config, path or "the command line", sources)
    except ArgumentError as err:
        raise explain_source(err, sources) from None
    if options["layers"] not in ("auto", "all", "unit"):
        raise ArgumentError(f"--layers must be auto, all or unit, got {options['layers']!r}.")
    model = model_spec(options, model_section, data)
    model_config = build_config(model)
    devices = _positive_int(options, "devices") or accel.node
    processes = _positive_int(options, "processes") or max(1, math.ceil(devices / accel.node))
    if devices % processes:
        raise ArgumentError(f"--devices {devices} must divide evenly over --processes {processes}.")
    per_node = min(devices // processes, accel.node)
    if options["sweep"] and options["choices"]:
        raise ArgumentError(
            "--choices compares settings on the run's own mesh: drop --sweep (or plan the "
            "meshes first, then --choices with the chosen --sharding_axis_dims)."
        )
    # An online RL run with rollout_devices r trains on the others (the engine has r).
    rollout = getattr(args, "rollout_devices", 0) or 0
    training = len(rollout_split(range(devices), rollout)[0])
    if options["sweep"]:
        meshes = sweep_meshes(training, per_node, args.micro_batch_size, model_config)
        if not meshes:
            raise ArgumentError(
                f"No mesh over {training} devices splits the micro-batch of "
                f"{args.micro_batch_size} rows: raise total_batch_size."
            )
    else:
        meshes = [list(args.sharding_axis_dims)]
    arguments = {**args.to_dict(), "compilation_cache_dir": None, "report_to": ["jsonl"]}
    arguments["max_steps"] = args.max_steps if args.max_steps > 0 else 1000
    attention = model_section.get("attention_implementation")
    spec = {
        "model": model,
        "arguments": arguments,
        "devices": devices,
        "meshes": meshes,
        "layers": options["layers"],
        "attention": attention,
        "task": str(config.get("task") or DEFAULT_TASK),
        "accelerator": key,
        "topology": options["topology"],
        "compiler": options["compiler"],
        "per_node": per_node,
        "choices": choices(args) if options["choices"] else [(AS_CONFIGURED, {})],
    }
    where = f"{options['topology']} slice of " if chips else ""
    print(
        f"jaxtrain plan: {model_config.model_type} "
        f"({model_config.num_hidden_layers} layers) on {where}{devices} x {accel.name} "
        f"({processes} node(s) of {per_node})"
        + (f", {rollout} of them the engine's (rollout_devices)" if rollout else "")
        + f"; {len(meshes)} mesh(es) to compile",
        flush=True,
    )
    entries = run_worker(spec)
    compiler = next((e["compiler"] for e in entries if "compiler" in e), None)
    if compiler is not None:
        print(compiler_line(compiler, accel.name, attention), flush=True)
    for entry in entries:
        if "figures" in entry:
            entry["figures"]["devices"] = training
            entry["estimate"] = estimate(
                entry["figures"], accel, devices=training, per_node=per_node, dtype=args.dtype
            )
    if options["choices"]:
        print("\n".join(choices_table(entries)))
        best = next((e for e in entries if e["choice"] == AS_CONFIGURED and "estimate" in e), None)
    else:
        entries = ranked(entries)
        print("\n".join(table(entries)))
        best = next((e for e in entries if "estimate" in e), None)
    if best is not None:
        print("\n".join(details(best, accel.name)))
    out = plan_path(options, args, sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": model,
        "accelerator": accel.to_json(),
        "devices": devices,
        "processes": processes,
        "arguments": arguments,
        "attention": {"run": attention, "compiled": compiled_attention(compiler, attention)},
        "compiler": compiler,
        "meshes": [{k: v for k, v in e.items()} for e in entries],
    }
    for entry in report["meshes"]:
        entry.get("figures", {}).pop("collective_ops", None)  # per-op detail: large, internal
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out.resolve()}")
    return 0 if best is not None else 2

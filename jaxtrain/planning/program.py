"""Compile a run's own train step from shapes alone and read what XLA made of it.

Nothing is allocated and nothing is written: the run's Program (training/program.py) is built
from a ModelFactory (its state is `eval_shape`d) on a runtime over the target's devices, the
batch is ShapeDtypeStructs, and `Program.compile_train_step` lowers and compiles the step the
run would run (same loss, optimizer, sharding rules, remat policy, accumulation loop, XLA
options). No Trainer, output directory, loader or monitor is involved.
The executable then reports per-device memory (`memory_analysis`), FLOPs and bytes accessed
(`cost_analysis`) and its optimized HLO, from which hlo.py reads the collectives.

Depth. A 70B model's 80 layers unrolled take XLA:CPU minutes and gigabytes to compile, and
every layer compiles to the same per-device program. So a deep model compiles its repeating
unit of layers (u: 1, or the period of a per-layer pattern such as Gemma's sliding/global
alternation) twice and three times, and each figure is scaled linearly to the full depth:
    figure(L) = figure(2u) + (L/u - 2) * (figure(3u) - figure(2u)).
Not from one and two units: the first layer's backward pass overlaps the loss and the
embedding's, so the step from one to two layers differs from every later one (peak memory of a
test model: +3.41 MB for the second layer, +3.15 MB for each after it, a 5% error at 6 layers).
Parameters and optimizer state are exact either way (from the full model's shapes).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

from jaxtrain.observability.compiles import memory_summary
from jaxtrain.planning.hlo import KINDS, collectives
from jaxtrain.planning.hlo_costs import matmul_flops, memory_traffic
from jaxtrain.tasks import DEFAULT_TASK, get_task

# Compiling the whole model is the default up to this many layers.
WHOLE_MODEL_LAYERS = 4


def build_config(model: dict[str, Any]) -> Any:
    """The model config of a plan's model: {"hf_config": config.json's dict} or a jaxtrain
    model section (model_type and the config's fields). A config without a pad token pads
    with id 0: the compiled program is the same, and the Trainer's notice is not printed."""
    config = _config(model)
    if getattr(config, "pad_token_id", 0) is None:
        config = dataclasses.replace(config, pad_token_id=0)
    return config


def _config(model: dict[str, Any]) -> Any:
    if "hf_config" in model:
        from jaxtrain.hf.registry import get_family

        hf = model["hf_config"]
        source = model.get("source", "config.json")
        return get_family(hf.get("model_type"), source=source).from_hf_config(hf, source)
    from jaxtrain.models.classes import classes_for

    values = {k: v for k, v in model.items() if k not in ("source", "attention_implementation")}
    config_class, _ = classes_for(values.get("model_type"))
    return config_class.from_dict(values)


def layer_period(config: Any) -> int:
    """The smallest number of layers after which per-layer settings repeat (a
    vision-language model's: its decoder's)."""
    if hasattr(config, "text"):
        return layer_period(config.text)
    lists = _per_layer_lists(config)
    layers = int(config.num_hidden_layers)
    for period in range(1, layers + 1):
        repeats = all(all(v[i] == v[i % period] for i in range(layers)) for v in lists.values())
        if repeats and _sparse_pattern_repeats(config, period):
            return period
    return layers


def _per_layer_lists(config: Any) -> dict[str, list[Any]]:
    layers = int(config.num_hidden_layers)
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if isinstance(getattr(config, f.name), list) and len(getattr(config, f.name)) == layers
    }


def _sparse_pattern_repeats(config: Any, period: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", []) or [])
    return period % step == 0 and not dense


def with_layers(config: Any, layers: int) -> Any:
    """`config` cut to its first `layers` layers (per-layer lists cut alike; a
    vision-language model's decoder, its vision tower whole)."""
    if hasattr(config, "text"):
        return dataclasses.replace(config, text=with_layers(config.text, layers))
    cut = {name: values[:layers] for name, values in _per_layer_lists(config).items()}
    return dataclasses.replace(config, num_hidden_layers=layers, **cut)


def model_factory(config: Any, attention: str | None = None) -> Any:
    from flax import nnx

    from jaxtrain.models.classes import classes_for
    from jaxtrain.parallel import ModelFactory

    _, model_class = classes_for(getattr(config, "model_type", None))

    def build() -> Any:
        model = model_class(config, rngs=nnx.Rngs(0))
        if attention is not None:
            model.attention_implementation = attention
        return model

    return ModelFactory(build)


def compiled_figures(program: Any, executable: Any) -> dict[str, Any]:
    """Per-device memory, FLOPs and collectives of a compiled train step."""
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    cost = cost or {}  # a deviceless XLA:GPU executable has no cost analysis (None)
    devices = program.mesh.devices.size
    text = executable.as_text()
    ops = collectives(text, devices)
    by_kind = {
        kind: {
            "count": sum(c.executions for c in ops if c.kind == kind),
            "bytes": sum(c.bytes * c.executions for c in ops if c.kind == kind),
            "link_bytes": sum(c.link_bytes * c.executions for c in ops if c.kind == kind),
        }
        for kind in KINDS
    }
    return {
        "memory": memory_summary(executable, program.mesh.devices.flat[0].platform),
        # Per device. XLA's count of all ops, a loop body counted once; the dots' with loops.
        "xla_flops": float(cost.get("flops", 0.0)),
        # XLA:TPU's own estimate of the step's time (its cost model; a loop body counted once,
        # like its flops). None from the other compilers.
        "xla_optimal_seconds": cost.get("optimal_seconds"),
        "matmul_flops": matmul_flops(text),
        "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "bytes_accessed": memory_traffic(text),
        "collectives": by_kind,
        # (kind, link bytes per step, partition groups) for the link classes (roofline.py).
        "collective_ops": [
            {"kind": c.kind, "link_bytes": c.link_bytes * c.executions, "groups": c.groups}
            for c in ops
            if c.link_bytes
        ],
    }


def plan_step_program(
    config: Any,
    args: Any,
    devices: list[Any],
    attention: str | None = None,
    task: str = DEFAULT_TASK,
    settings: Any = None,
):
    """The Program of a `task` run of `config` with `args` over `devices` (nothing
    allocated): the task's model with its frozen parts and its objective, as its definition
    (jaxtrain/tasks) says its trainer builds them. `settings`: args' sections, when built."""
    definition = get_task(task)
    build = model_factory(config, attention).build
    from jaxtrain.config.sections import RunSettings
    from jaxtrain.parallel import ModelFactory
    from jaxtrain.runtime import Runtime
    from jaxtrain.training.program import ModelParts, Program

    runtime = Runtime.from_arguments(args, devices)
    settings = settings or RunSettings.from_arguments(args)
    model = ModelFactory(lambda: definition.model(build, settings))
    parts = ModelParts.adopt(model, settings.model)
    schedule = max(settings.loop.max_steps, 1)
    objective = None if definition.objective is None else definition.objective(settings)
    return Program(parts, runtime, settings, schedule_length=schedule, objective=objective)


def compile_step(
    program: Any, settings: Any, task: str = DEFAULT_TASK
) -> tuple[dict[str, Any], float]:
    """(figures, compile seconds) of a Program's train step, compiled from shapes (with a
    vision-language model's image slots: `images_per_row` images per row, each encoded);
    `settings`: the run's (config.sections.RunSettings)."""
    start = time.perf_counter()
    batch = get_task(task).batch(settings)
    data = settings.data
    a, m = data.accumulation_steps, data.micro_batch_size
    image_shape = getattr(program.parts.config, "image_shape", None)
    if image_shape is not None:
        shape = (a, m, data.images_per_row, *image_shape)
        batch = {**batch, "pixel_values": jax.ShapeDtypeStruct(shape, jax.numpy.float32)}
    routing = getattr(program.parts.config, "routing_shape", None)
    if routing is not None and getattr(settings.task, "routing_replay", False):  # GRPO's
        shape = (a, m, routing[0], data.seq_len, routing[1])
        batch = {**batch, "routing": jax.ShapeDtypeStruct(shape, jax.numpy.int16)}
    step = program.compile_train_step(program.abstract_state(), batch)
    seconds = time.perf_counter() - start
    return compiled_figures(program, step.compiled.executable), seconds


def _scale(small: Any, large: Any, extra: float) -> Any:
    """small + extra * (large - small), through nested dicts of numbers: `large` has one
    unit of layers more than `small`, the model `extra` units more."""
    if isinstance(small, dict):
        return {k: _scale(small[k], large[k], extra) for k in small}
    if isinstance(small, int | float) and not isinstance(small, bool):
        return small + extra * (large - small)
    return large


def _scaled_ops(small: list[dict], large: list[dict], extra: float) -> list[dict]:
    """Collective ops of the full depth, each kind and group's total following the same linear
    rule as every other figure."""

    def totals(ops: list[dict]) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for op in ops:
            key = (op["kind"], repr(op["groups"]))
            out[key] = out.get(key, 0.0) + op["link_bytes"]
        return out

    a, b = totals(small), totals(large)
    groups = {repr(op["groups"]): op["groups"] for op in small + large}
    scaled = []
    for key in sorted(set(a) | set(b)):
        value = a.get(key, 0.0) + extra * (b.get(key, 0.0) - a.get(key, 0.0))
        if value > 0:
            scaled.append({"kind": key[0], "link_bytes": value, "groups": groups[key[1]]})
    return scaled


def plan_program(
    config: Any,
    args: Any,
    devices: list[Any],
    *,
    layers: str = "auto",
    attention: str | None = None,
    task: str = DEFAULT_TASK,
) -> dict[str, Any]:
    """Everything `jaxtrain plan` reads from the compiled step for one mesh (args'
    sharding_axis_dims) over `devices`. `layers`: "all" compiles the whole model, "unit" the
    repeating unit twice and three times (scaled), "auto" the whole model up to
    WHOLE_MODEL_LAYERS layers."""
    from jaxtrain.config.parallel_checks import rollout_split
    from jaxtrain.config.sections import RunSettings
    from jaxtrain.parallel.dry_run import tree_bytes_per_device

    settings = RunSettings.from_arguments(args)
    engine_task = get_task(task).samples_on_engine
    # With rollout_devices r the engine has the last r devices and the others train: the
    # step is planned on those.
    r = settings.task.rollout_devices if engine_task else 0
    devices, rollout = rollout_split(devices, r)
    full = plan_step_program(config, args, devices, attention, task, settings)
    # The run's own check of its batch split, so a mesh that cannot take it says why in one
    # line (it failed inside the compile with JAX's sharding traceback).
    full.plan.batch.check(settings.data.micro_batch_size, settings.data.seq_len, "micro-batch size")
    abstract, shardings = full.abstract_state(), full.state_shardings
    # Frozen weights (a reference, a teacher, a LoRA base, quantized or not): state too.
    frozen = float(tree_bytes_per_device(full.rest, full.plan.param_shardings(full.rest)))
    full_shapes = (dict(full.mesh.shape), abstract.params)
    fp8_flops = fp8_model_flops(full, settings.data) if settings.model.fp8_matmuls else 0.0
    # Its rollouts run on the engine between updates: the engine's steps on the full model.
    sampler = sampler_figures(full, settings, rollout) if engine_task else None
    total_layers = int(config.num_hidden_layers)
    period = layer_period(config)
    whole = layers == "all" or (layers == "auto" and total_layers <= WHOLE_MODEL_LAYERS)
    whole = whole or 3 * period >= total_layers
    if whole:
        figures, seconds = compile_step(full, settings, task)
        method = f"whole model compiled ({total_layers} layers)"
        compile_seconds = [seconds]
    else:
        del full

        def unit_step(units: int) -> tuple[dict[str, Any], float]:
            depth = with_layers(config, units * period)
            program = plan_step_program(depth, args, devices, attention, task, settings)
            return compile_step(program, settings, task)

        (small, s1), (large, s2) = unit_step(2), unit_step(3)
        extra = total_layers / period - 2
        figures = _scale(small, large, extra)
        figures["collective_ops"] = _scaled_ops(
            small["collective_ops"], large["collective_ops"], extra
        )
        method = (
            f"{2 * period} and {3 * period} of {total_layers} layers compiled, every figure "
            f"scaled linearly to {total_layers} layers"
        )
        compile_seconds = [s1, s2]
    params = tree_bytes_per_device(abstract.params, shardings.params)
    figures["state"] = {
        "parameters": float(params),
        "optimizer_state": float(tree_bytes_per_device(abstract.opt_state, shardings.opt_state)),
        "gradients": float(params),  # one per parameter, inside XLA's temporaries
        "frozen": frozen,
    }
    figures["peak_bytes"] = figures["memory"]["peak"]
    figures["shape_estimate_bytes"] = shape_estimate(
        full_shapes, config, settings, figures["state"]
    )
    figures["method"] = method
    figures["compile_seconds"] = compile_seconds
    figures["num_parameters"] = int(
        sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params))
    )
    figures["model_flops"] = model_flops(config, settings.data, figures["num_parameters"])
    figures["fp8_model_flops"] = fp8_flops
    if sampler is not None:
        figures["sampler"] = sampler
    return figures


def sampler_figures(program: Any, settings: Any, rollout: list[Any] = ()) -> dict[str, Any]:
    """Memory and compile time of the engine GRPO samples on (trainers/grpo_source.py): every
    prefill and decode bucket it compiles, on the policy's parameters and its page pool; on
    the training devices, or replicated on `rollout` (the rollout_devices). With
    max_staleness k, the rounds in flight each sample from a copy of the parameters that
    launched them: k copies beside the engine (`async_copies_bytes`, per device)."""
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxtrain.parallel.dry_run import tree_bytes_per_device
    from jaxtrain.serving.plan import plan_engine
    from jaxtrain.trainers.grpo_sampler import rollout_engine_shape

    abstract = program.abstract_state()
    params, rest, sharding = abstract.params, program.rest, None
    copy_bytes = tree_bytes_per_device(params, program.state_shardings.params)
    if rollout:  # the policy replicated on the engine's devices, its frozen part too
        sharding = NamedSharding(Mesh(np.array(rollout), ("rollout",)), PartitionSpec())
        params, rest = (
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), t)
            for t in (params, rest)
        )
        copy_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    policy = nnx.merge(program.graphdef, params, rest).model
    figures = plan_engine(
        policy,
        rollout_engine_shape(settings),
        max_prompt_tokens=settings.task.max_prompt_length,
        sharding=sharding,
        logprobs_mode="processed",
        record_routing=hasattr(policy.config, "routing_shape"),  # as the sampler's (a MoE's)
    )
    return {"memory": {k: figures[k] for k in ("peak", "temporaries", "pool_bytes")},
            "shapes": figures["shapes"], "compile_seconds": figures["compile_seconds"],
            "devices": len(rollout) or None,  # None: the training devices
            "async_copies_bytes": float(settings.task.max_staleness * copy_bytes)}  # fmt: skip


def fp8_model_flops(program: Any, data: Any) -> float:
    """The model FLOPs of one step that a run with fp8_matmuls computes in float8: 6 per
    token (forward and backward) for each trained weight of a projection that runs in
    float8 (every flattened projection but the output head: training/program.py)."""
    from flax import nnx

    from jaxtrain.models.layers import Projection, dense_in_ndim

    abstract = program.abstract_state()
    trained = dict(nnx.to_flat_state(abstract.params))
    merged = nnx.merge(program.graphdef, abstract.params, program.rest)
    weights = sum(
        math.prod(trained[(*path, "kernel")].get_value().shape)
        for path, module in nnx.iter_modules(merged)
        if isinstance(module, Projection)
        and module.fp8
        and dense_in_ndim(module.equation) is not None
        and (*path, "kernel") in trained
    )
    return 6.0 * weights * data.global_batch_size * data.seq_len


def shape_estimate(
    full_shapes: tuple[dict[str, int], Any], config: Any, settings: Any, state: dict[str, float]
) -> float:
    """Per-device bytes from shapes alone, for a compiler that frees each layer's gathered
    weights and full-size gradient after use (XLA's GPU and TPU schedulers bound them; XLA:CPU
    keeps every layer's at once): the state, the gradients, activations (dry_run's estimate)
    and two layers' worth of gathered weights and unreduced gradients in float32."""
    from jaxtrain.parallel.dry_run import activation_bytes_estimate

    mesh_shape, params = full_shapes
    dtype_bytes = np.dtype(settings.model.dtype or np.float32).itemsize
    activations = activation_bytes_estimate(
        config,
        mesh_shape,
        settings.data.micro_batch_size,
        settings.data.seq_len,
        dtype_bytes=dtype_bytes,
        remat=settings.model.remat_policy,
    )
    total_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    if hasattr(config, "num_parameters"):  # a frozen (LoRA, quantized) base is gathered too
        total_params = max(total_params, config.num_parameters())
    layer = 4.0 * total_params / int(config.num_hidden_layers) / mesh_shape.get("tp", 1)
    fixed = state["parameters"] + state["optimizer_state"] + state["gradients"]
    fixed += state.get("frozen", 0.0)
    return fixed + float(activations or 0) + 2 * 2 * layer


def model_flops(config: Any, data: Any, num_parameters: int) -> float:
    """Model FLOPs of one step whose rows are all real tokens (the Trainer's count, flops.py);
    `data`: the run's DataSettings."""
    from jaxtrain.observability.flops import FlopsCounter

    rows = data.global_batch_size
    seq = data.seq_len
    ones = np.ones((rows, seq), np.int32)
    full = {"input_ids": ones, "attention_mask": ones, "labels": ones}
    return FlopsCounter(config, num_parameters).batch_flops(full)

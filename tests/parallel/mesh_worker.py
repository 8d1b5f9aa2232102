"""Subprocess worker for tests/parallel: 8 CPU devices, one import of JAX for every check.

`python mesh_worker.py OUT_DIR` writes OUT_DIR/results.json with what the tests assert.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    MESHES,
    LossRecorder,
    eval_dataset,
    factory,
    parallel_arguments,
    token_dataset,
)
from flax import nnx  # noqa: E402

from jaxtrain import Trainer  # noqa: E402
from jaxtrain.parallel import ShardingPlan, ShardingRules, build_mesh  # noqa: E402


def params_of(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state.params))]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def main(out_dir: str) -> None:
    out = Path(out_dir)
    results: dict = {"runs": {}}
    dataset = token_dataset()
    finals = {}
    for name, dims in MESHES.items():
        devices = jax.devices()[: int(np.prod(dims))]
        recorder = LossRecorder()
        extra = {"save_steps": 2} if name == "fsdp8" else {}
        with_eval = name in ("single", "dp2_fsdp2_tp2")  # sharded eval batches too
        if with_eval:
            extra.update(evaluation_strategy="steps", eval_steps=3)
        trainer = Trainer(
            arguments=parallel_arguments(str(out / name), sharding_axis_dims=dims, **extra),
            model=factory(),
            dataset_train=dataset,
            dataset_eval=eval_dataset() if with_eval else None,
            callbacks=[recorder],
            devices=devices,
        )
        if name == "fsdp8":  # a ModelFactory's model stays abstract until the state is made
            results["abstract_before_train"] = all(
                isinstance(x, jax.ShapeDtypeStruct)
                for x in jax.tree.leaves(trainer.program.parts.params)
            )
        output = trainer.train()
        finals[name] = params_of(output.state)
        run = {"losses": recorder.losses, "eval_loss": output.metrics.get("eval/loss")}
        run["mesh"] = list(output.mesh.shape.values())
        info = json.loads((out / name / "run_info.json").read_text())
        run["run_info_num_devices"] = info["num_devices"]
        # Per-device shard shapes of the parameters and the Adam moments.
        leaves = jax.tree_util.tree_leaves_with_path(output.state.params)
        run["shards"] = {
            jax.tree_util.keystr(p): [list(x.shape), list(x.addressable_shards[0].data.shape)]
            for p, x in leaves
        }
        run["num_devices_used"] = len(jax.tree.leaves(output.state.params)[0].sharding.device_set)
        opt_leaves = [
            x for x in jax.tree.leaves(output.state.opt_state) if getattr(x, "ndim", 0) >= 2
        ]
        run["opt_shards"] = sorted({str(x.sharding.spec) for x in opt_leaves})
        if name == "dp8":
            # The loop owns its compiled step; compile the same one again to read its HLO.
            host_batch = next(trainer.train_source.loader.batches())
            batch = trainer.sharding_plan.batch.to_global(host_batch, micro_axis=True)
            hlo = trainer.program.compile_train_step(output.state, batch).executable.as_text()
            run["hlo_all_gather"] = hlo.count("all-gather")
            run["hlo_all_reduce"] = hlo.count("all-reduce")
        if name == "fsdp8":
            results["dry_run"] = trainer.dry_run()
            # The jitted init: its outputs are sharded, its buffers never hold a full copy.
            init = trainer.program.parts.factory.state_and_rest_initializer(
                trainer.program._new_state,
                trainer.program.state_shardings,
                trainer.sharding_plan,
                trainer.program.rest,
            )
            compiled = init.lower().compile()
            outs = jax.tree.leaves(compiled.output_shardings[0])  # the state; no rest here
            expected = jax.tree.leaves(trainer.program.state_shardings)
            ndims = [x.ndim for x in jax.tree.leaves(trainer.program.abstract_state())]
            run["init_out_shardings_match"] = all(
                a.is_equivalent_to(b, n) for a, b, n in zip(outs, expected, ndims, strict=True)
            )
            stats = compiled.memory_analysis()
            total = sum(
                x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.program.abstract_state())
            )
            run["init_total_state_bytes"] = int(total)
            run["init_output_bytes_per_device"] = int(stats.output_size_in_bytes)
            run["init_temp_bytes_per_device"] = int(stats.temp_size_in_bytes)
        results["runs"][name] = run
    base = finals["single"]
    for name in MESHES:
        results["runs"][name]["max_param_diff"] = max_diff(base, finals[name])

    # Resume the fsdp=8 run's step-2 checkpoint on 4 devices with another mesh.
    for name, dims in {"resume_dp2_fsdp2": (2, 2, 1, 1, 1)}.items():
        trainer = Trainer(
            arguments=parallel_arguments(
                str(out / name),
                sharding_axis_dims=dims,
                resume_from=str(out / "fsdp8" / "checkpoints" / "2"),
            ),
            model=factory(),
            dataset_train=dataset,
            devices=jax.devices()[:4],
        )
        output = trainer.train()
        results["runs"][name] = {
            "step": int(output.state.step),
            "max_param_diff": max_diff(finals["fsdp8"], params_of(output.state)),
            "devices": len(jax.tree.leaves(output.state.params)[0].sharding.device_set),
        }

    # Rules that do not fit fail early, naming the parameter.
    errors = {}
    for label, kwargs in {
        "tp8_kv_heads": dict(sharding_axis_dims=(1, 1, 1, 8, 1)),
        "regex_bad": dict(
            sharding_axis_dims=(1, 8, 1, 1, 1),
            sharding_regex_rules=[["norm/weight$", ["fsdp", "tp"]]],
        ),
    }.items():
        try:
            args = parallel_arguments(str(out / label), **kwargs)
            Trainer(arguments=args, model=factory(), dataset_train=dataset).program.state_shardings  # noqa: B018
            errors[label] = None
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            errors[label] = f"{type(err).__name__}: {err}"
    results["rule_errors"] = errors
    plan = ShardingPlan(build_mesh((2, 2, 1, 2, 1)))
    spec = plan.sharding_for("model/layers/0/mlp/down_proj/kernel", (128, 32), ("mlp", "embed"))
    results["sharding_for"] = str(spec.spec)
    # User rules and regex rules, asked for one parameter at a time.
    mesh = build_mesh((1, 4, 1, 2, 1))
    down = ("model/layers/0/mlp/down_proj/kernel", (64, 32), ("mlp", "embed"))
    results["rule_specs"] = {
        "default": str(ShardingRules(mesh).spec_for(*down)),
        "mlp_on_fsdp": str(ShardingRules(mesh, {"mlp": "fsdp", "embed": "tp"}).spec_for(*down)),
        "regex": str(
            ShardingRules(
                mesh, regex_rules=[["down_proj/kernel$", [None, ["fsdp", "tp"]]]]
            ).spec_for(*down)
        ),
        "no_axes_custom": str(ShardingRules(mesh).spec_for("my/weight", (12, 40), None)),
    }
    # ModelFactory.create: a concrete model whose arrays are born sharded, equal to eager init.
    plan = ShardingPlan(build_mesh((1, 8, 1, 1, 1)))
    sharded = nnx.state(factory().create(plan), nnx.Param)
    eager = nnx.state(factory().build(), nnx.Param)
    results["factory_create"] = {
        "max_diff": max_diff(
            [np.asarray(x) for x in jax.tree.leaves(sharded)],
            [np.asarray(x) for x in jax.tree.leaves(eager)],
        ),
        "sharded_leaves": sum(
            len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
            for x in jax.tree.leaves(sharded)
        ),
        "leaves": len(jax.tree.leaves(sharded)),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

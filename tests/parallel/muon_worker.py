"""Subprocess worker: Muon on dp2 x fsdp2 x tp2 (8 CPU devices) against one device.

`python muon_worker.py OUT_DIR` writes OUT_DIR/results.json:
- "update": two optimizer updates of the same parameters and gradients, under the run's own
  state shardings on the mesh and on one device (their largest relative difference), and
  the mesh shardings of the matrices Muon orthogonalised (they must be split, or the test
  proves nothing);
- "resume": the largest difference between a 3-step Muon run on the mesh and the same run
  stopped at step 2 and resumed (0: bit-exact).
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
from common import factory, parallel_arguments, token_dataset  # noqa: E402

from jaxtrain import Trainer  # noqa: E402
from jaxtrain.config.sections import RunSettings  # noqa: E402
from jaxtrain.runtime import Runtime  # noqa: E402
from jaxtrain.training.optim import muon_dimension_numbers  # noqa: E402
from jaxtrain.training.program import ModelParts, Program  # noqa: E402
from jaxtrain.training.state import param_logical_axes  # noqa: E402

MUON = dict(optimizer="muon", weight_decay=0.1, momentum=0.9, learning_rate=0.02)
MESH = (2, 2, 1, 2, 1)


def updates_on(dims, out: Path) -> tuple[list[np.ndarray], dict[str, str]]:
    """Two updates of fixed parameters by fixed gradients, sharded as a run shards them."""
    # No global-norm clip: its norm sums every gradient in an order that depends on the
    # sharding (a last-bit difference before any optimizer runs), which is not Muon's.
    args = parallel_arguments(str(out / "never"), sharding_axis_dims=dims, clip_grad=0.0, **MUON)
    runtime = Runtime.from_arguments(args, jax.devices()[: int(np.prod(dims))])
    parts = ModelParts.adopt(factory(), RunSettings.from_arguments(args).model)
    program = Program(parts, runtime, RunSettings.from_arguments(args), schedule_length=10)
    state = program.create_state()
    rng = np.random.default_rng(0)
    grads = [
        jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), state.params)
        for _ in range(2)
    ]
    shardings = program.state_shardings

    def update(params, opt_state, grads):
        import optax

        updates, opt_state = program.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), updates, opt_state

    step = jax.jit(
        update,
        in_shardings=(shardings.params, shardings.opt_state, shardings.params),
        out_shardings=(shardings.params, shardings.params, shardings.opt_state),
    )
    params, opt_state, all_updates = state.params, state.opt_state, []
    for g in grads:
        params, updates, opt_state = step(params, opt_state, jax.device_put(g, shardings.params))
        all_updates += [np.asarray(x) for x in jax.tree.leaves(jax.device_get(updates))]
    specs = muon_dimension_numbers(state.params, param_logical_axes(state.params))
    is_spec = lambda x: x is None or hasattr(x, "reduction_axis")  # noqa: E731
    flat_specs = jax.tree.leaves(specs, is_leaf=is_spec)
    flat_params = jax.tree_util.tree_leaves_with_path(params)
    split = {
        jax.tree_util.keystr(path): str(p.sharding.spec)
        for (path, p), spec in zip(flat_params, flat_specs)
        if spec is not None
    }
    return all_updates, split


def run(out: Path, *, stop: int | None = None):
    class StopAt:
        def on_step_end(self, trainer, state, metrics, step):
            if step == stop:
                trainer.should_stop = True

    trainer = Trainer(
        arguments=parallel_arguments(str(out), sharding_axis_dims=MESH, save_final=True, **MUON),
        model=factory(),
        dataset_train=token_dataset(),
        callbacks=[StopAt()],
        devices=jax.devices(),
    )
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.train().state.params))]


def main(out_dir: str) -> None:
    out = Path(out_dir)
    single, _ = updates_on((1, 1, 1, 1, 1), out)
    mesh, split = updates_on(MESH, out)
    rel = max(
        float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in zip(single, mesh)
    )
    whole = run(out / "whole")
    run(out / "split", stop=2)
    resumed = run(out / "split")
    resume = max(float(np.abs(a - b).max()) for a, b in zip(whole, resumed))
    results = {"update": {"max_rel": rel, "muon_shardings": split}, "resume": resume}
    (out / "results.json").write_text(json.dumps(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])

"""Can the installed CUDA plugin compile for GPUs that are not attached (issue 40, part 1)?

Run on a GPU machine: `python bench/gpu_probe/probe.py OUT_DIR`. It creates a GPU topology
through `jax.experimental.topologies` (1 and 8 GPUs), compiles the same small train-like
step for it and for the attached GPU, and writes what it found to OUT_DIR/probe.json,
with the topology's target description (a text proto) when the plugin hands it out.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path


def step_fn():
    import jax
    import jax.numpy as jnp

    def loss(w, x):
        h = jnp.tanh(x @ w[0])
        for layer in w[1:]:
            h = jnp.tanh(h @ layer)
        return jnp.mean(h**2)

    return jax.jit(jax.value_and_grad(loss))


def compile_figures(devices) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices), ("d",))
    w = [jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P()))] * 4
    x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    start = time.perf_counter()
    compiled = step_fn().lower(w, x).compile()
    m = compiled.memory_analysis()
    return {
        "seconds": time.perf_counter() - start,
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "peak_memory_in_bytes": getattr(m, "peak_memory_in_bytes", None),
        "flops": (compiled.cost_analysis() or {}).get("flops")
        if isinstance(compiled.cost_analysis(), dict)
        else None,
    }


def main(out: Path) -> None:
    import jax
    from jax.experimental import topologies

    found: dict = {"jax": jax.__version__, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS")}
    for count in (1, 8):
        key = f"topology_1x1x{count}"
        try:
            topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}")
            devices = topo.devices
            found[key] = {"devices": len(devices), "kind": devices[0].device_kind}
            found[key]["compile"] = compile_figures(devices)
        except Exception as err:
            found[key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
    try:
        from jax._src import xla_bridge as xb

        raw = xb.make_pjrt_topology("cuda", "", topology="1x1x1")
        found["topology_object"] = [n for n in dir(raw) if not n.startswith("__")]
        for name in ("attributes", "platform_version", "platform"):
            if hasattr(raw, name):
                value = getattr(raw, name)
                found[f"topology_{name}"] = str(value() if callable(value) else value)[:20000]
        if hasattr(raw, "serialize"):
            (out / "topology_1x1x1.bin").write_bytes(raw.serialize())
    except Exception as err:
        found["topology_raw_error"] = f"{type(err).__name__}: {err}"
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        try:
            found["attached"] = {
                "devices": [str(d) for d in jax.devices()],
                "compile": compile_figures(jax.devices()[:1]),
            }
        except Exception as err:
            found["attached"] = {"error": f"{type(err).__name__}: {err}"}
    name = "probe_cpu_platforms.json" if os.environ.get("JAX_PLATFORMS") == "cpu" else "probe.json"
    (out / name).write_text(json.dumps(found, indent=1, default=str))
    print(
        json.dumps({k: v for k, v in found.items() if k != "topology_object"}, default=str)[:3000]
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""One of two real JAX processes that all-reduce 16 MB in a loop, for the tests of a peer
killed at a collective (test_peer_loss.py).

`python collective_worker.py PORT PROCESS_ID PEER_TIMEOUT_S MARKER` joins the cluster the
way `jaxtrain train` does (its peer watch armed) and prints `iter <n>` every 10 all-reduces.
The transfer is large enough that a peer killed meanwhile breaks the collective here (Gloo:
"Connection reset by peer") rather than leaving it waiting. An exception that reaches the
interpreter is first written to MARKER, then handed to jaxtrain's handling: the test learns
that the collective failed, and what the process printed after that.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def main(port: str, process_id: str, peer_timeout_s: str, marker: str) -> None:
    from jaxtrain import TrainingArguments
    from jaxtrain.config.sections import RuntimeSettings
    from jaxtrain.parallel.distributed import initialize_distributed

    args = TrainingArguments(
        output_dir=str(Path(marker).parent / "run"),
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        distributed_timeout_s=60,
        peer_timeout_s=float(peer_timeout_s),
    )
    initialize_distributed(RuntimeSettings.from_arguments(args))
    jaxtrain_hook = sys.excepthook

    def hook(kind, value, traceback) -> None:
        Path(marker).write_text(f"{kind.__name__}: {value}")
        jaxtrain_hook(kind, value, traceback)

    sys.excepthook = hook

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("d",))
    rows = np.ones((1, 4_000_000), np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), rows)
    total = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, P()))
    n = 0
    while True:
        total(x).block_until_ready()
        n += 1
        if n % 10 == 0:
            print(f"iter {n}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])

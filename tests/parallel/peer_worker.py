"""One of two real JAX processes training with a checkpoint every step, for the tests of a
lost peer (test_peer_loss.py).

`python peer_worker.py PORT PROCESS_ID RUN_DIR STEPS PEER_TIMEOUT_S` trains in RUN_DIR
(resuming from its newest committed checkpoint, as a rerun of `jaxtrain train` would) and
prints `start <step>` when training starts and `step <n>` after each step's log, so the test
can kill or stop it at a chosen step. At the end process 0 writes RUN_DIR/final.npz: every
parameter, gathered from both processes, then waits LINGER_S seconds (environment, default
0). Process 0 also writes RUN_DIR/service.pid, the pid of the coordination service process
it started. PAUSE (environment) makes one process sleep inside a step (Announce), and
STEP_TIMEOUT_S sets the progress watch.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import MESHES, factory, parallel_arguments, token_dataset  # noqa: E402


class Announce:
    """Prints where training starts and each logged step, flushed for the driving test."""

    def on_train_start(self, trainer, state) -> None:
        print(f"start {int(state.step)}", flush=True)

    def on_log(self, trainer, logs, step) -> None:
        print(f"step {step}", flush=True)

    def on_step_start(self, trainer, state, step) -> None:
        # PAUSE="<process> <step> <seconds>": that process sleeps inside step <step> + 1,
        # after its peers dispatched it: they wait in its collectives meanwhile.
        rank, at, seconds = (os.environ.get("PAUSE") or "-1 0 0").split()
        if int(rank) == trainer.runtime.process_index and step == int(at):
            print(f"pausing in step {step + 1}", flush=True)
            time.sleep(float(seconds))


def main(port: str, process_id: str, run_dir: str, steps: str, peer_timeout_s: str) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxtrain import Trainer
    from jaxtrain.parallel import distributed

    rows = [{"input_ids": list(r["input_ids"])} for r in token_dataset()]
    args = parallel_arguments(
        run_dir,
        sharding_axis_dims=MESHES["dp2_fsdp2_tp2"],
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=int(process_id),
        distributed_timeout_s=60,
        peer_timeout_s=float(peer_timeout_s),
        max_steps=int(steps),
        save_steps=1,
        save_final=True,
        step_timeout_s=float(os.environ["STEP_TIMEOUT_S"])
        if "STEP_TIMEOUT_S" in os.environ
        else None,
    )
    trainer = Trainer(arguments=args, model=factory(), dataset_train=rows, callbacks=[Announce()])
    if jax.process_index() == 0:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        Path(run_dir, "service.pid").write_text(str(distributed._service.pid))
    output = trainer.train()
    leaves = jax.tree_util.tree_leaves_with_path(output.state.params)
    gathered = {
        jax.tree_util.keystr(path): np.asarray(multihost_utils.process_allgather(x, tiled=True))
        for path, x in leaves
    }
    if jax.process_index() == 0:
        np.savez(Path(run_dir, "final.npz"), **gathered)
        # Process 0 ends LINGER_S after process 1 (as when it writes a long report): a
        # peer that ended normally must not be taken for a lost one.
        time.sleep(float(os.environ.get("LINGER_S", "0")))


if __name__ == "__main__":
    main(*sys.argv[1:6])

"""`jaxtrain launch --ray`: one `jaxtrain <command>` per Ray actor, as one JAX cluster.

Each actor runs the command exactly as `jaxtrain` would on that host; the cluster settings
reach it through JAXTRAIN_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID (set by the
actor), and a restart after a dead process runs the same command again, which resumes from
the run's newest committed checkpoint (resume_if_possible). Process 0's output reaches this
terminal through Ray's log forwarding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.distributed.cluster import ClusterConfig, run_on_cluster


@dataclasses.dataclass
class CliJob:
    """`jaxtrain <tokens...>` in every process; the result is the command's exit code."""

    tokens: list[str]

    def run(self, context: Any) -> int:
        from jaxtrain.cli import main

        return main(list(self.tokens))


def launch_ray(tokens: list[str], cluster: ClusterConfig) -> int:
    """Run `jaxtrain <tokens>` on `cluster.num_processes` actors; process 0's exit code."""
    from jaxtrain.distributed.cluster import Attempt

    attempts: list[Attempt] = []

    def report(kind: str, step: int, data: Any) -> None:
        if kind == "restart":
            print(f"jaxtrain launch: process {data['process']} died; restarting", flush=True)

    try:
        code = int(
            run_on_cluster(lambda _: CliJob(tokens), cluster, on_event=report, attempts=attempts)
        )
    finally:
        for attempt in attempts:
            where = ", ".join(
                f"{p['process_id']}: pid {p['pid']} on {p['node']}" for p in attempt.processes
            )
            print(
                f"jaxtrain launch: attempt {attempt.number}: {len(attempt.processes)} processes ({where})"
            )
    return code

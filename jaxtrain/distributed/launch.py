"""`jaxtrain launch --ray`: one `jaxtrain <command>` per Ray actor, as one JAX cluster.

Each actor runs the command exactly as `jaxtrain` would on that host; the cluster settings
reach it through JAXTRAIN_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID (set by the
actor), and a restart after a dead process runs the same command again, which resumes from
the run's newest committed checkpoint (resume_if_possible). Process 0's output reaches this
terminal through Ray's log forwarding; the launch exits with the first non-zero exit code of
any process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxtrain.distributed.cluster import ClusterConfig, run_on_cluster


@dataclasses.dataclass
class CliJob:
    """`jaxtrain <tokens...>` in every process; the result is the command's exit code.

    `entry` is the CLI's main function, handed in by the caller (it pickles by reference):
    the launcher runs a command line and does not import the CLI that imports it.
    """

    tokens: list[str]
    entry: Callable[[list[str]], int]

    def run(self, context: Any) -> int:
        return self.entry(list(self.tokens))


def launch_ray(tokens: list[str], cluster: ClusterConfig, entry: Callable[[list[str]], int]) -> int:
    """Run `entry(tokens)` (`jaxtrain <tokens>`) on `cluster.num_processes` actors; the
    first non-zero exit code in process order (0 when every process succeeded), so a
    failure of any process fails the launch."""
    from jaxtrain.distributed.cluster import Attempt

    attempts: list[Attempt] = []

    def report(kind: str, step: int, data: Any) -> None:
        if kind == "restart":
            print(f"jaxtrain launch: process {data['process']} died; restarting", flush=True)

    try:
        codes = [
            int(code)
            for code in run_on_cluster(
                lambda _: CliJob(tokens, entry),
                cluster,
                on_event=report,
                attempts=attempts,
                every_process=True,
            )
        ]
    finally:
        for attempt in attempts:
            where = ", ".join(
                f"{p['process_id']}: pid {p['pid']} on {p['node']}" for p in attempt.processes
            )
            print(
                f"jaxtrain launch: attempt {attempt.number}: {len(attempt.processes)} processes ({where})"
            )
    failed = [(process, code) for process, code in enumerate(codes) if code != 0]
    if failed:
        listed = ", ".join(f"process {process}: {code}" for process, code in failed)
        print(f"jaxtrain launch: non-zero exit codes ({listed})", flush=True)
        return failed[0][1]
    return 0

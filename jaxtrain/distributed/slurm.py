"""SLURM's sbatch scripts: `jaxtrain launch --slurm ... train cfg.yaml` prints (or submits) a
script that starts one `jaxtrain train` per task; each reads its place in the job's JAX cluster
from SLURM's variables (parallel/slurm_env.py, through parallel/distributed.py).
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from typing import Any

from jaxtrain.errors import ArgumentError


@dataclasses.dataclass
class SbatchOptions:
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int | None = None
    gpus_per_task: int | None = None
    time: str | None = None  # SLURM's format, e.g. "2:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str = "jaxtrain"
    output: str = "jaxtrain-%j.out"
    # Lines run before srun (module loads, `source venv/bin/activate`, exports).
    setup: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_task"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ArgumentError(f"--{name} must be a positive integer, got {value!r}.")
        for name in ("time", "partition", "account", "job_name", "output"):
            value = getattr(self, name)
            # An #SBATCH line is split at blanks: "my job" would name the job "my".
            if value is not None and (not str(value) or any(c in str(value) for c in " \t\n\"'")):
                raise ArgumentError(
                    f"--{name} {value!r}: an #SBATCH value cannot hold blanks or quotes (sbatch "
                    "splits its lines at blanks); use e.g. "
                    f"{str(value).strip().replace(' ', '_')!r}."
                )


def sbatch_script(command: list[str], options: SbatchOptions, python: str | None = None) -> str:
    """A batch script running `jaxtrain <command...>` once per task (nodes x tasks_per_node).

    Each task becomes one JAX process; the cluster settings come from SLURM's variables,
    so the command needs no addresses or ranks.
    """
    if not command:
        raise ArgumentError(
            "launch --slurm needs the jaxtrain command to run, e.g. train cfg.yaml."
        )
    python = python or sys.executable
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={options.job_name}",
        f"#SBATCH --nodes={options.nodes}",
        f"#SBATCH --ntasks-per-node={options.tasks_per_node}",
        f"#SBATCH --output={options.output}",
    ]
    optional: dict[str, Any] = {
        "cpus-per-task": options.cpus_per_task,
        "gpus-per-task": options.gpus_per_task,
        "time": options.time,
        "partition": options.partition,
        "account": options.account,
    }
    lines += [f"#SBATCH --{k}={v}" for k, v in optional.items() if v is not None]
    lines += ["", "set -eo pipefail", *options.setup]
    # One JAX process per task; jaxtrain reads SLURM_PROCID, SLURM_NTASKS and the node list.
    run = shlex.join([python, "-m", "jaxtrain.cli", *command])
    lines += [f"srun --kill-on-bad-exit=1 {run}", ""]
    return "\n".join(lines)


def submit(script: str) -> str:
    """Submit `script` with sbatch; returns sbatch's answer (the job id line)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ArgumentError(
            "sbatch was not found on PATH: run `jaxtrain launch --slurm` without --submit to "
            "print the script, or run it on a SLURM login node."
        )
    result = subprocess.run([sbatch], input=script, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ArgumentError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip()

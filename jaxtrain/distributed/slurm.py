"""SLURM: read a task's cluster settings from SLURM's variables, and write sbatch scripts.

Inside `srun`, every task knows the job's node list, the number of tasks and its own rank;
that is all a JAX cluster needs. The coordinator is the first node of the job, on a port
derived from the job id, so every task computes the same address without talking.
`jaxtrain launch --slurm ... train cfg.yaml` prints (or submits) a script that starts one
`jaxtrain train` per task; each finds its settings here (parallel/distributed.py).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from typing import Any

from jaxtrain.arguments import ArgumentError

# Coordinator ports: PORT_BASE + job id modulo PORT_SPAN, the same on every task of a job.
PORT_BASE, PORT_SPAN = 20000, 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order.

    "node[01-03,07],gpu5" -> ["node01", "node02", "node03", "node07", "gpu5"]; zero padding
    of a range is kept ("node[008-010]" -> node008, node009, node010).
    """
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if not prefix.strip():
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ArgumentError(f"SLURM node list {nodelist!r}: cannot read range {part!r}.")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    return hosts


@dataclasses.dataclass(frozen=True)
class SlurmTask:
    """One SLURM task's place in the job's JAX cluster."""

    job_id: int
    num_processes: int
    process_id: int
    local_id: int
    nodes: tuple[str, ...]

    @property
    def coordinator_address(self) -> str:
        return f"{self.nodes[0]}:{PORT_BASE + self.job_id % PORT_SPAN}"


def _int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ArgumentError(f"SLURM variable {name}={env[name]!r} is not an integer.") from None


def slurm_task(env: dict[str, str]) -> SlurmTask | None:
    """The task described by SLURM's variables, or None outside a multi-task SLURM step.

    Needs SLURM_JOB_ID, SLURM_NTASKS (or SLURM_NPROCS), SLURM_PROCID and the node list
    (SLURM_STEP_NODELIST inside srun, else SLURM_JOB_NODELIST / SLURM_NODELIST).
    """
    ntasks_name = "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_NPROCS"
    if not env.get("SLURM_JOB_ID") or not env.get(ntasks_name):
        return None
    nodelist = next(
        (
            env[n]
            for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if env.get(n)
        ),
        None,
    )
    if env.get("SLURM_PROCID") is None or nodelist is None:
        return None
    num = _int(env, ntasks_name)
    if num <= 1:
        return None
    process_id = _int(env, "SLURM_PROCID")
    if not 0 <= process_id < num:
        raise ArgumentError(f"SLURM_PROCID={process_id} is outside 0..{num - 1} (SLURM_NTASKS).")
    nodes = tuple(expand_nodelist(nodelist))
    if not nodes:
        raise ArgumentError(f"SLURM node list {nodelist!r} names no node.")
    return SlurmTask(
        job_id=_int(env, "SLURM_JOB_ID"),
        num_processes=num,
        process_id=process_id,
        local_id=_int(env, "SLURM_LOCALID") if env.get("SLURM_LOCALID") else 0,
        nodes=nodes,
    )


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

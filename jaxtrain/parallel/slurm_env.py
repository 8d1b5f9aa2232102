"""SLURM's variables as a JAX cluster: inside `srun`, every task knows the job's node list, the
number of tasks and its own rank; that is all a JAX cluster needs. The coordinator is the first
node of the job, on a port derived from the job id, so every task computes the same address
without talking (parallel/distributed.py reads it; `jaxtrain launch --slurm` writes the
scripts that start the tasks: jaxtrain/distributed/slurm.py).
"""

from __future__ import annotations

import dataclasses
import re

from jaxtrain.errors import ArgumentError

__all__ = ["PORT_BASE", "PORT_SPAN", "SlurmTask", "expand_nodelist", "slurm_task"]

# Coordinator ports: PORT_BASE + job id modulo PORT_SPAN, the same on every task of a job.
PORT_BASE, PORT_SPAN = 20000, 20000


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order.

    "node[01-03,07],gpu5" -> ["node01", "node02", "node03", "node07", "gpu5"]; zero padding
    of a range is kept ("node[008-010]" -> node008, node009, node010); a name of several
    ranges expands as `scontrol show hostnames` does ("r[1-2]-n[1-2]" -> r1-n1, r1-n2, r2-n1,
    r2-n2).
    """
    # The names are the commas outside brackets apart.
    name = r"(?:[^,\[\]]|\[[^\[\]]*\])+"
    if not re.fullmatch(f"{name}(?:,{name})*", nodelist):
        raise ArgumentError(f"SLURM node list {nodelist!r}: unbalanced brackets or empty names.")
    names = re.findall(name, nodelist)
    return [host for name in names if name.strip() for host in _expand_name(name, nodelist)]


def _expand_name(name: str, nodelist: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    prefix, rest = name[: match.start()], _expand_name(name[match.end() :], nodelist)
    hosts = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ArgumentError(f"SLURM node list {nodelist!r}: cannot read range {part!r}.")
        for number in range(int(low), int(high or low) + 1):
            hosts += [f"{prefix}{number:0{len(low)}d}{suffix}" for suffix in rest]
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

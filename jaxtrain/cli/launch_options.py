"""The options of `jaxtrain launch` and `jaxtrain tune`: type, default and doc of each, one
table per backend, read by the parsers (launch.py) and by `--help`."""

from __future__ import annotations

from typing import Any, NamedTuple


class Option(NamedTuple):
    kind: type
    default: Any
    doc: str


RAY_OPTIONS: dict[str, Option] = {
    "address": Option(str, None, "Ray cluster to join (auto, ray://host:10001); None: local."),
    "num_processes": Option(int, 1, "JAX processes, one Ray actor each."),
    "devices_per_process": Option(int, None, "CPU only: XLA host devices per process."),
    "cpus_per_process": Option(float, 1.0, "CPUs Ray reserves per process."),
    "gpus_per_process": Option(float, 0.0, "GPUs Ray reserves per process."),
    "max_restarts": Option(int, 0, "Restarts after a process died (each resumes)."),
    "placement_strategy": Option(str, "PACK", "PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."),
    "teardown_timeout_s": Option(float, 60.0, "Bound on tearing a failed attempt down."),
    "start_timeout_s": Option(
        float, 300.0, "Bound on reserving resources and forming the cluster."
    ),
}
SLURM_OPTIONS: dict[str, Option] = {
    "nodes": Option(int, 1, "Nodes of the job (#SBATCH --nodes)."),
    "tasks_per_node": Option(int, 1, "JAX processes per node."),
    "cpus_per_task": Option(int, None, "CPUs per process."),
    "gpus_per_task": Option(int, None, "GPUs per process."),
    "time": Option(str, None, "Wall-time limit in SLURM's format, e.g. 2:00:00."),
    "partition": Option(str, None, "SLURM partition."),
    "account": Option(str, None, "SLURM account."),
    "job_name": Option(str, "jaxtrain", "Name of the job."),
    "output": Option(str, "jaxtrain-%j.out", "Log file of the job (%j: the job id)."),
    "setup": Option(
        list, [], "A line run before srun (repeatable), e.g. 'source .venv/bin/activate'."
    ),
}
TUNE_OPTIONS: dict[str, Option] = {
    "num_samples": Option(int, 1, "Trials (each grid point this many times)."),
    "scheduler": Option(str, "asha", "asha (stops poor trials early) or fifo."),
    "metric": Option(str, "eval/loss", "Metric the trials are ranked by."),
    "mode": Option(str, "min", "min or max of the metric."),
    "max_concurrent_trials": Option(int, None, "Trials at once; None: as resources allow."),
    "cpus_per_trial": Option(float, 1.0, "CPUs Ray reserves per trial."),
    "gpus_per_trial": Option(float, 0.0, "GPUs Ray reserves per trial."),
    "grace_period": Option(int, 1, "asha: evaluations before a trial may be stopped."),
    "reduction_factor": Option(
        float, 2.0, "asha: the share of trials kept at each rung is 1/this."
    ),
    "tune_dir": Option(str, "runs/tune", "Directory of the trials and best.yaml."),
    "address": Option(str, None, "Ray cluster to join; None: a local one."),
}


def options_help(options: dict[str, Option]) -> str:
    """One entry per option: `--name TYPE  (default: ...)` and its doc."""
    return "\n".join(
        f"  --{name} {option.kind.__name__.upper()}  (default: {option.default!r})\n"
        f"      {option.doc}"
        for name, option in options.items()
    )

"""`jaxtrain launch` and `jaxtrain tune`: runs past one machine (Ray, SLURM, Ray Tune).

The machinery is in jaxtrain.distributed (Ray is imported only when a cluster starts); this
module turns the command line into its options.
"""

from __future__ import annotations

from typing import Any

from jaxtrain.cli.launch_options import RAY_OPTIONS, SLURM_OPTIONS, TUNE_OPTIONS, options_help
from jaxtrain.errors import ArgumentError

LAUNCH_USAGE = """usage:
  jaxtrain launch --ray [--address auto] [--num_processes N] [--devices_per_process D]
                  [--cpus_per_process C] [--gpus_per_process G] [--max_restarts R]
                  COMMAND [ARGS...]          (e.g. train cfg.yaml --learning_rate 1e-3)
  jaxtrain launch --slurm [--nodes N] [--tasks_per_node T] [--cpus_per_task C]
                  [--gpus_per_task G] [--time 2:00:00] [--partition P] [--account A]
                  [--job_name NAME] [--setup 'source .venv/bin/activate'] [--submit]
                  COMMAND [ARGS...]
"""

TUNE_USAGE = """usage:
  jaxtrain tune [CONFIG.yaml] --search KEY=SPACE(VALUES) [--search ...] [--num_samples N]
                [--scheduler asha|fifo] [--metric eval/loss] [--mode min|max]
                [--max_concurrent_trials N] [--cpus_per_trial C] [--gpus_per_trial G]
                [--grace_period N] [--reduction_factor F] [--tune_dir runs/tune]
                [--address auto] [--field value ...]
  SPACE: loguniform(a,b) uniform(a,b) quniform(a,b,q) randint(a,b) choice(x,y,..) grid(x,y,..)
"""

_RAY_OPTIONS = {name: option.kind for name, option in RAY_OPTIONS.items()}
_SLURM_OPTIONS = {name: option.kind for name, option in SLURM_OPTIONS.items()}


def launch_help() -> str:
    """`jaxtrain launch --help`: the usage, then every option with its type, default, doc."""
    return (
        f"{LAUNCH_USAGE}\nRun a jaxtrain COMMAND as one JAX process per Ray actor or SLURM task.\n\n"
        f"--ray options:\n{options_help(RAY_OPTIONS)}\n\n"
        f"--slurm options (the sbatch script is printed, or submitted with --submit):\n"
        f"{options_help(SLURM_OPTIONS)}\n"
        "  --submit\n      Submit the script with sbatch instead of printing it.\n"
    )


def tune_help() -> str:
    """`jaxtrain tune --help`: the usage, then every option with its type, default, doc."""
    return (
        f"{TUNE_USAGE}\nRay Tune over `jaxtrain train` trials; the best config goes to "
        "TUNE_DIR/best.yaml.\n\n"
        "  --search STR  (repeatable)\n      KEY=SPACE(VALUES): a TrainingArguments field or "
        "section.field (lr is learning_rate) and its search space.\n"
        f"{options_help(TUNE_OPTIONS)}\n"
        "  --field value\n      Any other option is passed to every trial's `jaxtrain train`.\n"
    )


def _typed(name: str, kind: type, raw: str) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ArgumentError(f"--{name} {raw!r}: expected {kind.__name__}.") from None


def split_launch(tokens: list[str]) -> tuple[str, dict[str, Any], list[str]]:
    """(backend "ray" or "slurm", its options, the jaxtrain command to run)."""
    backend: str | None = None
    options: dict[str, Any] = {}
    index = 0
    while index < len(tokens) and tokens[index].startswith("--"):
        name, _, inline = tokens[index][2:].partition("=")
        index += 1
        if name in ("ray", "slurm"):
            if backend not in (None, name):
                raise ArgumentError("choose one of --ray and --slurm.")
            backend = name
            continue
        if name == "submit":
            options["submit"] = True
            continue
        kinds = {**_RAY_OPTIONS, **_SLURM_OPTIONS}
        if name not in kinds:
            raise ArgumentError(f"unknown option --{name}.\n\n{LAUNCH_USAGE}")
        if not inline:
            if index >= len(tokens):
                raise ArgumentError(f"--{name} needs a value.")
            inline, index = tokens[index], index + 1
        if kinds[name] is list:
            options.setdefault(name, []).append(inline)
        else:
            options[name] = _typed(name, kinds[name], inline)
    if backend is None:
        raise ArgumentError(f"pass --ray or --slurm.\n\n{LAUNCH_USAGE}")
    command = tokens[index:]
    if not command:
        raise ArgumentError(f"the jaxtrain command to run is missing.\n\n{LAUNCH_USAGE}")
    allowed = set(_RAY_OPTIONS if backend == "ray" else [*_SLURM_OPTIONS, "submit"])
    wrong = sorted(set(options) - allowed)
    if wrong:
        raise ArgumentError(f"launch --{backend}: option(s) {wrong} belong to the other backend.")
    return backend, options, command


def cmd_launch(tokens: list[str], entry: Any = None) -> int:
    """`entry`: the CLI's main, run by every process (jaxtrain.cli.main passes itself)."""
    if any(t in ("-h", "--help") for t in tokens[:2]):  # `launch --help`, `launch --ray --help`
        print(launch_help(), end="")
        return 0
    backend, options, command = split_launch(tokens)
    if backend == "slurm":
        from jaxtrain.distributed.slurm import SbatchOptions, sbatch_script, submit

        submit_it = options.pop("submit", False)
        if "setup" in options:
            options["setup"] = list(options["setup"])
        script = sbatch_script(command, SbatchOptions(**options))
        print(submit(script) if submit_it else script, end="" if not submit_it else "\n")
        return 0
    from jaxtrain.distributed.cluster import ClusterConfig
    from jaxtrain.distributed.launch import launch_ray

    return launch_ray(command, ClusterConfig(**options), entry)


_TUNE_OPTIONS = {name: option.kind for name, option in TUNE_OPTIONS.items()}


def cmd_tune(tokens: list[str]) -> int:
    if any(t in ("-h", "--help") for t in tokens):
        print(tune_help(), end="")
        return 0
    from jaxtrain.cli.run_config import parse_overrides, resolve_config
    from jaxtrain.cli.tune import parse_search, tune_runs

    path, rest = (
        (tokens[0], tokens[1:]) if tokens and not tokens[0].startswith("--") else (None, tokens)
    )
    searches, options, passthrough = [], {}, []
    index = 0
    while index < len(rest):
        name, _, inline = (
            rest[index][2:].partition("=") if rest[index].startswith("--") else ("", "", "")
        )
        if name == "search" or name in _TUNE_OPTIONS:
            if not inline:
                if index + 1 >= len(rest):
                    raise ArgumentError(f"--{name} needs a value.\n\n{TUNE_USAGE}")
                inline, index = rest[index + 1], index + 1
            if name == "search":
                searches.append(parse_search(inline))
            else:
                options[name] = _typed(name, _TUNE_OPTIONS[name], inline)
        else:
            passthrough.append(rest[index])
        index += 1
    base = resolve_config(path, parse_overrides(passthrough))
    from jaxtrain.distributed.cluster import ClusterConfig, ensure_ray

    ensure_ray(ClusterConfig(address=options.pop("address", None)))
    summary = tune_runs(base, searches, output_dir=options.pop("tune_dir", "runs/tune"), **options)
    for trial, info in summary.trials.items():
        metric = [v for k, v in info.items() if k not in ("values", "iterations")]
        early = " (stopped early)" if info["iterations"] < summary.max_t else ""
        print(
            f"{trial}: {info['values']} -> {metric[0] if metric else None} after "
            f"{info['iterations']}/{summary.max_t} evaluations{early}"
        )
    print(
        f"best: {summary.best_metric:.4f}; config: {summary.best_config} "
        f"(jaxtrain train {summary.best_config})"
    )
    return 0

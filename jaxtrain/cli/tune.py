"""Ray Tune over jaxtrain runs: each trial is one `jaxtrain train` with sampled values.

`--search lr=loguniform(1e-4,1e-2)` names a config key (a TrainingArguments field, or
`model.x` / `data.x`; `lr` is short for learning_rate) and a Tune search space. Every trial
writes its resolved config to `<output_dir>/trials/<trial>/config.yaml`, trains in its own
output_dir, and reports each evaluation to Tune (the metric "eval_loss" by default), so a
scheduler such as ASHA can stop bad trials early. The best trial's config is written as
`<output_dir>/best.yaml` with its own output_dir: `jaxtrain train best.yaml` trains it again.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.arguments import ArgumentError

ALIASES = {"lr": "learning_rate"}
SPACES = ("loguniform", "uniform", "quniform", "randint", "choice", "grid")
SCHEDULERS = ("asha", "fifo")


@dataclasses.dataclass(frozen=True)
class SearchSpec:
    key: str  # "learning_rate" or "model.hidden_size"
    space: str  # one of SPACES
    values: tuple[Any, ...]

    def domain(self) -> Any:
        from ray import tune

        if self.space == "grid":
            return tune.grid_search(list(self.values))
        if self.space == "choice":
            return tune.choice(list(self.values))
        return getattr(tune, self.space)(*self.values)


def parse_search(text: str) -> SearchSpec:
    """`key=space(a,b,...)` -> SearchSpec; the key is checked against the config's fields."""
    match = re.fullmatch(r"\s*([\w.]+)\s*=\s*(\w+)\((.*)\)\s*", text)
    if match is None:
        raise ArgumentError(
            f"--search {text!r}: expected KEY=SPACE(VALUES), e.g. lr=loguniform(1e-4,1e-2) or "
            "model.hidden_size=choice(64,128)."
        )
    key, space, raw = match.groups()
    key = ALIASES.get(key, key)
    if space not in SPACES:
        raise ArgumentError(f"--search {text!r}: unknown space {space!r}; use one of {SPACES}.")
    values = tuple(_value(v.strip()) for v in raw.split(",") if v.strip())
    arity = {"loguniform": 2, "uniform": 2, "quniform": 3, "randint": 2}
    if space in arity and len(values) != arity[space]:
        raise ArgumentError(
            f"--search {text!r}: {space} takes {arity[space]} values, got {len(values)}."
        )
    if not values:
        raise ArgumentError(f"--search {text!r}: {space} needs at least one value.")
    _check_key(key, text)
    return SearchSpec(key, space, values)


def _value(text: str) -> Any:
    """A number when it reads as one ("1e-4" too, which YAML keeps as a string), else text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("'\"")


def _check_key(key: str, text: str) -> None:
    from jaxtrain.arguments import TrainingArguments

    section, _, field = key.partition(".")
    if field:
        if section not in ("model", "data", "sample"):
            raise ArgumentError(f"--search {text!r}: unknown section {section!r}.")
        return  # section keys are checked when the trial's config is split
    if section not in {f.name for f in dataclasses.fields(TrainingArguments)}:
        raise ArgumentError(
            f"--search {text!r}: {section!r} is not a TrainingArguments field (lr is short "
            "for learning_rate; sections: model.x, data.x)."
        )


def apply_values(config: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`config` with the sampled `values` set (dotted keys go into their section)."""
    out = copy.deepcopy(config)
    for key, value in values.items():
        section, _, field = key.partition(".")
        if field:
            out.setdefault(section, {})[field] = value
        else:
            out[key] = value
    return out


def metric_name(key: str) -> str:
    """Tune reads "/" in a metric name as nesting: report eval/loss as eval_loss."""
    return key.replace("/", "_")


class ReportToTune:
    """A Trainer callback: every evaluation becomes one Tune result (one iteration)."""

    def on_evaluate(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        from ray import tune

        tune.report({**{metric_name(k): float(v) for k, v in metrics.items()}, "step": step})


def run_trial(params: dict[str, Any], base: dict[str, Any], root: str) -> None:
    """One Tune trial: write its config and train it with `jaxtrain train`."""
    from ray import tune

    from jaxtrain.cli.commands import cmd_train
    from jaxtrain.cli.run_config import save_config

    trial_dir = Path(root) / "trials" / tune.get_context().get_trial_id()
    config = apply_values(base, params)
    config["output_dir"] = str(trial_dir)
    path = save_config(config, trial_dir)
    code = cmd_train([str(path)], callbacks=[ReportToTune()])
    if code != 0:
        raise RuntimeError(f"trial {trial_dir.name}: jaxtrain train exited with {code}")


@dataclasses.dataclass
class TuneSummary:
    best_config: Path  # the runnable YAML of the best trial
    best_metric: float
    # trial id -> {"values", "iterations", metric}
    trials: dict[str, dict[str, Any]]
    max_t: int


def evaluations_per_run(config: dict[str, Any]) -> int:
    """How many times one trial reports: evaluations at eval_steps up to max_steps."""
    from jaxtrain.cli.run_config import split_config

    args = split_config(config)[0]
    if args.max_steps <= 0 or args.evaluation_strategy != "steps":
        raise ArgumentError(
            "jaxtrain tune needs max_steps > 0 and evaluation_strategy 'steps' (each "
            "evaluation is one Tune result), with an eval dataset (data.eval_files)."
        )
    return -(-args.max_steps // args.eval_steps)


def tune_runs(
    base: dict[str, Any],
    searches: list[SearchSpec],
    *,
    output_dir: str,
    num_samples: int = 1,
    scheduler: str = "asha",
    metric: str = "eval/loss",
    mode: str = "min",
    max_concurrent_trials: int | None = None,
    cpus_per_trial: float = 1.0,
    gpus_per_trial: float = 0.0,
    grace_period: int = 1,
    reduction_factor: float = 2.0,
) -> TuneSummary:
    """Run the search on the joined Ray cluster and write <output_dir>/best.yaml."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if scheduler not in SCHEDULERS:
        raise ArgumentError(f"--scheduler {scheduler!r}: use one of {SCHEDULERS}.")
    if mode not in ("min", "max"):
        raise ArgumentError(f"--mode {mode!r}: use min or max.")
    if not searches:
        raise ArgumentError("jaxtrain tune needs at least one --search KEY=SPACE(VALUES).")
    max_t = evaluations_per_run(base)
    name = metric_name(metric)
    root = Path(output_dir).absolute()
    chosen = (
        ASHAScheduler(max_t=max_t, grace_period=grace_period, reduction_factor=reduction_factor)
        if scheduler == "asha"
        else FIFOScheduler()
    )
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base, root=str(root)),
        {"cpu": cpus_per_trial, "gpu": gpus_per_trial},
    )
    tuner = tune.Tuner(
        trainable,
        param_space={s.key: s.domain() for s in searches},
        tune_config=tune.TuneConfig(
            metric=name,
            mode=mode,
            scheduler=chosen,
            num_samples=num_samples,
            max_concurrent_trials=max_concurrent_trials,
            reuse_actors=True,  # one process runs trial after trial: JAX is imported once
        ),
        run_config=tune.RunConfig(name="tune", storage_path=str(root / "ray"), verbose=1),
    )
    results = tuner.fit()
    trials = {}
    for result in results:
        if result.error is not None:
            raise ArgumentError(f"a Tune trial failed: {result.error}") from result.error
        trials[result.path.rsplit("/", 1)[-1]] = {
            "values": dict(result.config),
            "iterations": int(result.metrics.get("training_iteration", 0)),
            name: result.metrics.get(name),
        }
    # The best trial: the lowest (or highest) metric at its last report.
    best = results.get_best_result(metric=name, mode=mode, scope="last")
    config = apply_values(base, best.config)
    config["output_dir"] = str(root / "best")
    best_path = root / "best.yaml"
    best_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return TuneSummary(
        best_config=best_path,
        best_metric=float(best.metrics[name]),
        trials=trials,
        max_t=max_t,
    )

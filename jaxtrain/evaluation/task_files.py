"""lm-eval task files, found and checked before anything runs: local files and local data only.

A task is named in `eval_tasks` (or `jaxtrain evaluate --tasks`) by the path of its YAML
file, or by the name of one of jaxtrain's example tasks (examples/*.yaml). The YAML is read
with lm-eval's own loader (its `include:` and `!function` tags work as in lm-eval), then:

- `dataset_path` must be one of the datasets library's file formats (json, csv, parquet,
  text, arrow) with `dataset_kwargs.data_files`, or a local directory: anything else is a
  dataset on the Hugging Face Hub, which would be downloaded;
- every data file must exist; a relative one is read relative to the YAML file (lm-eval
  reads it relative to the working directory: jaxtrain makes it absolute, so a task runs
  the same from anywhere);
- every metric must be one of lm-eval's own (others come from HF `evaluate`, downloaded);
- groups, Python task classes and multimodal tasks are not supported (yet).

Each failure is one line naming the task, its file and the fix (TaskError).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxtrain.errors import TaskError

__all__ = ["EXAMPLES", "TaskSpec", "example_tasks", "read_task", "resolve_task"]

EXAMPLES = Path(__file__).parent / "examples"
# The datasets library's packaged builders that read local files (data_files).
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


def example_tasks() -> list[str]:
    """The names of jaxtrain's example tasks."""
    return sorted(p.stem for p in EXAMPLES.glob("*.yaml"))


class TaskSpec:
    """A checked task: its name, its YAML file and its configuration (lm-eval's keys, the
    data files absolute)."""

    def __init__(self, name: str, path: Path, config: dict[str, Any]):
        self.name, self.path, self.config = name, path, config

    def __repr__(self) -> str:
        return f"TaskSpec({self.name!r}, {str(self.path)!r})"


def resolve_task(spec: str) -> Path:
    """The YAML file of `spec`: a path, or the name of an example task."""
    looks_like_path = spec.endswith((".yaml", ".yml")) or "/" in spec or "\\" in spec
    path = Path(spec).expanduser() if looks_like_path else EXAMPLES / f"{spec}.yaml"
    if not path.is_file():
        where = f"no file {path.resolve()}" if looks_like_path else "no such example task"
        raise TaskError(
            f"eval task {spec!r}: {where}; give the path of an lm-eval task YAML file, or one "
            f"of jaxtrain's example tasks: {', '.join(example_tasks())}."
        )
    return path.resolve()


def _data_files(value: Any) -> list[tuple[Any, Any]]:
    """(key, file or pattern) of data_files given as a string, a list or {split: ...}."""
    if isinstance(value, str):
        return [(None, value)]
    if isinstance(value, Sequence):
        return [(i, v) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return [((split, i), v) for split, files in value.items() for i, v in _data_files(files)]
    return [(None, value)]


def _absolute_files(value: Any, base: Path, where: str) -> Any:
    """`data_files` with every file absolute (relative to `base`), each checked to exist."""

    def one(file: Any) -> str:
        if not isinstance(file, str) or not file:
            raise TaskError(f"{where}: data file {file!r} must be a path.")
        if "://" in file:
            raise TaskError(
                f"{where}: data file {file!r} is a URL, which would be downloaded; use a local "
                "copy of the file."
            )
        path = Path(file).expanduser()
        path = path if path.is_absolute() else base / path
        matched = glob.glob(str(path))
        if not matched:
            raise TaskError(
                f"{where}: data file {file!r} does not exist (looked at {path}); fix the path "
                "(relative paths are relative to the task's YAML file)."
            )
        files = [m for m in matched if os.path.isfile(m)]
        if files and all(os.path.getsize(m) == 0 for m in files):
            raise TaskError(
                f"{where}: data file {file!r} is empty (0 bytes); a task needs its documents, "
                "one per line (jsonl)."
            )
        return str(path)

    if isinstance(value, str):
        return one(value)
    if isinstance(value, dict):
        return {split: _absolute_files(files, base, where) for split, files in value.items()}
    if isinstance(value, Sequence):
        return [one(v) for v in value]
    return one(value)


def check_local(name: str, path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its data files absolute, or a TaskError (see the module docstring)."""
    where = f"eval task {name!r} ({path})"
    if "group" in config or isinstance(config.get("task"), list):
        raise TaskError(
            f"{where} is a group of tasks, which jaxtrain does not run yet; list its tasks' "
            "YAML files in eval_tasks instead."
        )
    if "class" in config:
        raise TaskError(f"{where} is a Python task class, which jaxtrain does not run yet.")
    if config.get("doc_to_image") or config.get("doc_to_audio"):
        raise TaskError(f"{where} is multimodal; jaxtrain evaluates text tasks only.")
    if config.get("custom_dataset") is not None:
        raise TaskError(f"{where} uses custom_dataset, which jaxtrain does not run yet.")
    dataset = config.get("dataset_path")
    kwargs = dict(config.get("dataset_kwargs") or {})
    if dataset in FILE_BUILDERS:
        if not kwargs.get("data_files"):
            raise TaskError(
                f"{where}: dataset_path {dataset!r} reads local files; give them as "
                "dataset_kwargs: {data_files: {test: my_task.jsonl}}."
            )
        kwargs["data_files"] = _absolute_files(kwargs["data_files"], path.parent, where)
    elif isinstance(dataset, str) and (path.parent / dataset).expanduser().is_dir():
        config["dataset_path"] = str((path.parent / dataset).expanduser().resolve())
    else:
        raise TaskError(
            f"{where}: dataset_path {dataset!r} is not local data: it would be downloaded from "
            "the Hugging Face Hub, and jaxtrain evaluates local data only. Use dataset_path: "
            "json (or csv, parquet, text, arrow) with dataset_kwargs.data_files of local files."
        )
    for metric in config.get("metric_list") or []:
        check_metric(where, metric, custom=config.get("process_results") is not None)
    return {**config, "dataset_kwargs": kwargs}


def check_metric(where: str, metric: Any, *, custom: bool) -> None:
    """A metric lm-eval computes itself (others come from HF `evaluate`: downloaded)."""
    from lm_eval.api.registry import METRIC_REGISTRY

    name = metric.get("metric") if isinstance(metric, dict) else None
    if not isinstance(name, str) or custom:
        return  # a callable, or computed by the task's own process_results
    if metric.get("hf_evaluate") or name not in METRIC_REGISTRY:
        raise TaskError(
            f"{where}: metric {name!r} is not one of lm-eval's own metrics; it would be "
            "downloaded (HF evaluate). Use a built-in one (acc, acc_norm, exact_match, ...)."
        )


def read_task(spec: str) -> TaskSpec:
    """The checked TaskSpec of `spec` (a YAML path or an example task's name)."""
    path = resolve_task(spec)
    try:
        # lm-eval's own reader: `include:` files merged, `!function` tags imported from the
        # Python files beside the YAML. lm-eval has no public function for this; the
        # package pins the lm-eval versions it was tested with (pyproject.toml `eval`).
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError as err:
        raise TaskError(
            f"eval tasks need lm-eval ({err}); install it with pip install 'jaxtrain[eval]'."
        ) from None
    try:
        config = load_yaml(path, resolve_func=True)
    except Exception as err:  # a YAML syntax error, a missing include or function file
        detail = " ".join(str(err).split())
        raise TaskError(
            f"eval task {spec!r} ({path}): cannot be read ({type(err).__name__}: {detail})."
        ) from err
    name = config.get("task")
    if "group" not in config and not isinstance(name, str):
        raise TaskError(f"eval task {spec!r} ({path}) has no `task:` name.")
    return TaskSpec(name if isinstance(name, str) else spec, path, check_local(spec, path, config))

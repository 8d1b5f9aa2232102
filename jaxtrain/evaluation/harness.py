"""lm-eval tasks, loaded once and scored as often as asked: the same evaluation as lm-eval's
`simple_evaluate`, on a model given as an lm-eval `LM` (jaxtrain's JaxLM, or any other).

    suite = TaskSuite(["python_mc", "path/to/my_task.yaml"], limit=100)   # checked now
    logs = suite.evaluate(lm)   # {"eval/python_mc/acc": 0.41, "eval/python_mc/acc_stderr": ...}

The tasks are checked and built when the suite is made (task_files.py: a missing file, a
missing data file or a task that would download is a one-line TaskError then, before any
training), so a run never fails at its first evaluation for a typo. Each evaluation builds the
requests again (lm-eval's `evaluate`), runs them through the model, and returns every
metric of every task with its standard error under `eval/<task>/`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

from jaxtrain.errors import TaskError
from jaxtrain.evaluation.task_files import TaskSpec, read_task

__all__ = ["TaskSuite", "flatten_results"]

# lm-eval's defaults in simple_evaluate: the few-shot draw and the bootstrap of stderrs.
FEWSHOT_SEED = 1234
BOOTSTRAP_ITERS = 100_000


class TaskSuite:
    """The lm-eval tasks of `specs` (YAML paths or example names), checked and loaded.
    `limit`: documents per task (None: all); `num_fewshot`: overrides the tasks' own."""

    def __init__(
        self,
        specs: Sequence[str],
        *,
        limit: int | None = None,
        num_fewshot: int | None = None,
        bootstrap_iters: int = BOOTSTRAP_ITERS,
    ):
        self.specs: list[TaskSpec] = [read_task(spec) for spec in specs]
        names = [spec.name for spec in self.specs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise TaskError(f"eval tasks name {repeated} more than once; list each task once.")
        self.limit, self.bootstrap_iters = limit, bootstrap_iters
        self.tasks = self._load(num_fewshot)

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def _load(self, num_fewshot: int | None) -> dict[str, Any]:
        """lm-eval's tasks (their data read now), set up as simple_evaluate sets them up."""
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_defaults=False)
        tasks = {}
        for spec in self.specs:
            try:
                loaded = manager.load([spec.config])["tasks"]
            except Exception as err:  # a template or column the data lacks, ...
                detail = " ".join(str(err).split())[:300]
                raise TaskError(
                    f"eval task {spec.name!r} ({spec.path}): lm-eval cannot load it "
                    f"({type(err).__name__}: {detail})."
                ) from err
            for name, task in loaded.items():
                if num_fewshot is not None:
                    task.set_config(key="num_fewshot", value=num_fewshot)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
                tasks[name] = task
        return tasks

    def evaluate(self, lm: Any, *, raw: bool = False, samples: bool = False) -> dict[str, Any]:
        """Every task's metrics and standard errors (flatten_results) from `lm`; with `raw`,
        also lm-eval's own results under "lm_eval" (with `samples`: every document's
        requests and responses too)."""
        from lm_eval.evaluator import evaluate

        with _quiet():
            results = evaluate(
                lm=lm,
                task_dict={"tasks": self.tasks, "groups": {}},
                limit=self.limit,
                bootstrap_iters=self.bootstrap_iters,
                log_samples=samples,
            )
        logs: dict[str, Any] = flatten_results(results)
        if raw or samples:
            logs["lm_eval"] = results
        return logs


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's INFO lines and the progress bar it draws per task at every evaluation:
    between a training run's own lines they are noise (its warnings still show)."""
    import lm_eval.api.task as task_module

    logger = logging.getLogger("lm_eval")
    level, bar = logger.level, task_module.tqdm
    logger.setLevel(max(level, logging.WARNING))
    task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        logger.setLevel(level)
        task_module.tqdm = bar


def flatten_results(results: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """lm-eval's {"results": {task: {"acc,none": v, "acc_stderr,none": se}}} as flat logs:
    `eval/<task>/acc`, `eval/<task>/acc_stderr` (a filter other than "none" adds its name:
    `eval/<task>/exact_match/strict-match`). Values that are not numbers ("N/A") are left
    out."""
    logs: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool):
                continue
            metric, _, filter_name = key.partition(",")
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            name = f"{prefix}{task}/{metric}"
            if filter_name != "none":
                name += f"/{filter_name}"
            logs[name] = float(value)
    return logs

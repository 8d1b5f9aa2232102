"""Experiment trackers: JSONL (always), TensorBoard, Weights & Biases, MLflow.

Selected with `TrainingArguments.report_to`. Only process 0 writes. A tracker that cannot
start is a `TrackerError` before the first step (`check_trackers` runs when the Trainer is
built, `start_trackers` when training starts), never a crash mid-run. Each tracker reports a
small `state()` (the TensorBoard directory, the W&B / MLflow run id) that is stored in the
checkpoint, so a resumed run continues the same TensorBoard directory and the same W&B run.
"""

from __future__ import annotations

import importlib.util
import math
import netrc
import os
import time
from pathlib import Path
from typing import Any

from jaxtrain.errors import TrackerError
from jaxtrain.observability.logs import JsonlLog

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
_EXTRAS = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


def _numeric(values: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if key in ("step", "time") or not math.isfinite(value):
            continue
        out[key] = float(value)
    return out


def default_run_name() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S")


class JsonlTracker:
    name = "jsonl"

    def __init__(self, out_dir: Path, **_: Any):
        self._log = JsonlLog(out_dir / "metrics.jsonl")

    def log(self, step: int, values: dict[str, Any]) -> None:
        self._log.write(step, values)

    def log_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None: ...

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self._log.close()


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, out_dir: Path, *, run_name: str, start_step: int, resume: dict, **_: Any):
        from tensorboardX import SummaryWriter

        self.logdir = resume.get("logdir") or str(out_dir / "tensorboard" / run_name)
        # purge_step: TensorBoard hides events a crashed run wrote past the resumed step.
        self._writer = SummaryWriter(
            logdir=self.logdir, purge_step=start_step if resume.get("logdir") else None
        )

    def log(self, step: int, values: dict[str, Any]) -> None:
        for key, value in _numeric(values).items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        for name, h in histograms.items():
            self._writer.add_histogram_raw(f"weights/{name}", global_step=step, **h)

    def state(self) -> dict[str, Any]:
        return {"logdir": self.logdir}

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        out_dir: Path,
        *,
        run_name: str,
        project: str,
        config: dict,
        resume: dict,
        **_: Any,
    ):
        import wandb

        self._wandb = wandb
        # A resumed run passes its stored id: W&B appends to the same run.
        self._run = wandb.init(
            project=project,
            name=run_name,
            id=resume.get("run_id"),
            resume="allow" if resume.get("run_id") else None,
            dir=str(out_dir),
            config=config,
        )
        self.run_id = self._run.id

    def log(self, step: int, values: dict[str, Any]) -> None:
        numeric = _numeric(values)
        if numeric:
            self._run.log(numeric, step=step)

    def log_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        import numpy as np

        data = {}
        for name, h in histograms.items():
            edges = np.array([h["min"], *h["bucket_limits"]])
            data[f"weights/{name}"] = self._wandb.Histogram(
                np_histogram=(np.array(h["bucket_counts"]), edges)
            )
        self._run.log(data, step=step)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """Logs through an `MlflowClient` by explicit run id, never through `mlflow.log_*`: those
    use the calling thread's active run, and compiles are reported from a compile thread,
    where they would open a second run that is never ended."""

    name = "mlflow"
    _PARAMS_PER_CALL = 100  # MLflow's log_batch limit

    def __init__(
        self, out_dir: Path, *, run_name: str, project: str, config: dict, resume: dict, **_: Any
    ):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # No server configured: a local file store in the run directory (MLflow 3 keeps
            # it behind an opt-in; `mlflow ui --backend-store-uri <output_dir>/mlruns`).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out_dir / "mlruns").resolve().as_uri()
        self._client = client = MlflowClient(tracking_uri=uri)
        if resume.get("run_id"):
            self.run_id = resume["run_id"]
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(project)
            )
            self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[:500]) for k, v in config.items()]
            for i in range(0, len(params), self._PARAMS_PER_CALL):
                client.log_batch(self.run_id, params=params[i : i + self._PARAMS_PER_CALL])

    def log(self, step: int, values: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        numeric = _numeric(values)
        if numeric:
            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, step) for k, v in numeric.items()]
            self._client.log_batch(self.run_id, metrics=metrics)

    def log_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None: ...

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED")


TRACKER_CLASSES = {
    "jsonl": JsonlTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
    host = host.split("/")[0].split(":")[0]
    for path in (os.environ.get("NETRC"), Path.home() / ".netrc", Path.home() / "_netrc"):
        if path and Path(path).is_file():
            try:
                if netrc.netrc(str(path)).authenticators(host):
                    return True
            except (netrc.NetrcParseError, OSError):
                continue
    return False


def _writable_dir_for(path: Path) -> str | None:
    """Why `path` cannot become a directory we write into, or None when it can."""
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a directory"
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    return None if os.access(parent, os.W_OK) else f"{parent} is not writable"


def check_trackers(report_to: list[str], out_dir: str | Path) -> None:
    """Fail now, before anything compiles, when a selected tracker could not start."""
    out_dir = Path(out_dir)
    problem = _writable_dir_for(out_dir)
    if problem:
        raise TrackerError(f"output_dir: {problem}; metrics.jsonl cannot be written there.")
    for name in report_to:
        if name == "jsonl":
            continue
        if importlib.util.find_spec(_EXTRAS[name]) is None:
            raise TrackerError(
                f"report_to includes {name!r} but {_EXTRAS[name]} is not installed. "
                f"Install it with `pip install 'jaxtrain[{name}]'` or remove {name!r} from "
                "report_to."
            ) from None
        if name == "tensorboard":
            problem = _writable_dir_for(out_dir / "tensorboard")
            if problem:
                raise TrackerError(
                    f"report_to includes 'tensorboard' but {problem}. Remove it or choose "
                    "another output_dir."
                )
        if name == "wandb":
            mode = os.environ.get("WANDB_MODE", "").lower()
            if mode not in ("offline", "disabled", "dryrun") and not _wandb_has_credentials():
                raise TrackerError(
                    "report_to includes 'wandb' but W&B is not logged in (no WANDB_API_KEY, no "
                    "netrc entry). Run `wandb login`, set WANDB_API_KEY, or set "
                    "WANDB_MODE=offline to write the run locally and `wandb sync` it later."
                )


def start_trackers(
    report_to: list[str],
    out_dir: Path,
    *,
    run_name: str,
    project: str,
    config: dict[str, Any],
    start_step: int,
    resume: dict[str, dict[str, Any]],
) -> list[Any]:
    """Start JSONL plus every tracker in report_to; a failure is a TrackerError naming it."""
    started: list[Any] = []
    for name in ["jsonl", *[n for n in report_to if n != "jsonl"]]:
        try:
            started.append(
                TRACKER_CLASSES[name](
                    out_dir,
                    run_name=run_name,
                    project=project,
                    config=config,
                    start_step=start_step,
                    resume=resume.get(name, {}),
                )
            )
        except Exception as err:  # any failure of a third-party tracker at startup
            for tracker in started:
                tracker.close()
            raise TrackerError(
                f"tracker {name!r} (report_to) could not start: {type(err).__name__}: {err}. "
                f"Fix its configuration or remove {name!r} from report_to."
            ) from err
    return started

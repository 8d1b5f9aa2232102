"""One real tiny run shared by the observability tests: trained to step 6, stopped by a hook
(checkpoint), then resumed by a new Trainer to step 12, with JSONL, TensorBoard, W&B
(offline) and MLflow (file store) all on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from obs_helpers import StopAt, obs_trainer


@dataclass
class ResumedRun:
    out_dir: Path
    first_state: dict  # tracker_state() of the first Trainer
    second_state: dict  # tracker_state() of the resuming Trainer
    first_output: object
    second_output: object


@pytest.fixture(scope="session")
def wandb_offline(tmp_path_factory):
    """W&B in offline mode with its config and cache in a temporary directory."""
    home = tmp_path_factory.mktemp("wandb_home")
    values = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
    }
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, wandb_offline) -> ResumedRun:
    out_dir = tmp_path_factory.mktemp("obs") / "run"
    first = obs_trainer(out_dir, callbacks=[StopAt(6)])
    first_output = first.train()
    assert first_output.stop_reason == "callback"
    second = obs_trainer(out_dir)
    second_output = second.train()
    return ResumedRun(
        out_dir=out_dir,
        first_state=first.monitor.tracker_state(),
        second_state=second.monitor.tracker_state(),
        first_output=first_output,
        second_output=second_output,
    )

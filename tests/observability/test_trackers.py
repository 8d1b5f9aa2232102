"""JSONL, TensorBoard, W&B (offline) and MLflow outputs of a real run parse back; a resumed
run continues the same tracker runs; a tracker that cannot start fails at construction."""

import json
import struct
from collections import defaultdict
from pathlib import Path

import pytest
from obs_helpers import obs_trainer
from tensorboardX.proto import event_pb2

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.checkpointing import find_checkpoint, read_metadata
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.observability.trackers import TrackerError

TRAIN_KEYS = {
    "loss",
    "perplexity",
    "accuracy",
    "learning_rate",
    "grad_norm",
    "step_time_s",
    "data_wait_s",
    "tokens_per_second",
    "padded_tokens_per_second",
    "sequences_per_second",
    "tflops_per_device",
    "mfu",
    "memory/host_rss_gib",
}
LOG_STEPS = [2, 4, 6, 8, 10, 12]


def read_tensorboard(logdir: Path):
    """{tag: [(step, value)]} of scalars and {tag: [step]} of histograms, from the raw
    TFRecord framing: u64 length, u32 crc, Event proto, u32 crc."""
    scalars, histograms = defaultdict(list), defaultdict(list)
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("histo"):
                    histograms[value.tag].append(event.step)
                else:
                    scalars[value.tag].append((event.step, value.simple_value))
    return scalars, histograms


def read_wandb_records(path: Path):
    """The `Record` protos of a .wandb file: a 7-byte W&B header, then LevelDB-log blocks of
    32 KiB whose records (u32 crc, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last)
    hold them."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def read_wandb_history(path: Path) -> dict[str, list[tuple[int, float]]]:
    """{key: [(step, value)]} of a .wandb file's history records."""
    history = defaultdict(list)
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                history[key].append((record.history.step.num, json.loads(item.value_json)))
    return history


def test_jsonl_holds_every_metric_at_every_logging_step(resumed_run):
    records = read_jsonl(resumed_run.out_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == LOG_STEPS
    for record in train:
        assert set(record) >= TRAIN_KEYS, TRAIN_KEYS - set(record)
    assert [r["step"] for r in records if "eval/loss" in r] == [6, 12]
    # one compile of the train step per process (the first run, then the resumed one)
    assert [r["step"] for r in records if "compile/train_step_s" in r] == [0, 6]
    assert all(r["compile/train_step_count"] == 1 for r in records if "compile/train_step_s" in r)
    weights = [r for r in records if "weights/lm_head/kernel/norm" in r]
    assert [r["step"] for r in weights] == [3, 6, 9, 12]
    assert {"mean", "std", "min", "max", "norm"} == {
        k.rsplit("/", 1)[1] for k in weights[0] if k.startswith("weights/model/layers/all/")
    }


def test_tensorboard_events_parse_back_with_the_jsonl_values(resumed_run):
    logdirs = list((resumed_run.out_dir / "tensorboard").iterdir())
    assert len(logdirs) == 1  # the resumed run continued the same directory
    assert len(list(logdirs[0].glob("events.out.tfevents.*"))) == 2  # one file per process
    scalars, histograms = read_tensorboard(logdirs[0])
    records = read_jsonl(resumed_run.out_dir / "metrics.jsonl")
    for tag in ("loss", "learning_rate", "tokens_per_second", "mfu", "grad_norm"):
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        assert [s for s, _ in scalars[tag]] == LOG_STEPS
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in expected], rel=1e-6)
    assert [s for s, _ in scalars["eval/loss"]] == [6, 12]
    assert histograms["weights/lm_head/kernel"] == [3, 6, 9, 12]
    assert histograms["weights/model/layers/all/self_attn/o_proj/kernel"] == [3, 6, 9, 12]


def test_wandb_offline_writes_its_run_and_a_resume_continues_it(resumed_run):
    run_id = resumed_run.first_state["wandb"]["run_id"]
    assert resumed_run.second_state["wandb"]["run_id"] == run_id
    runs = sorted((resumed_run.out_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) >= 1
    assert all((run / f"run-{run_id}.wandb").stat().st_size > 0 for run in runs)


def test_mlflow_file_store_gets_the_metrics_of_one_run(resumed_run):
    run_id = resumed_run.first_state["mlflow"]["run_id"]
    assert resumed_run.second_state["mlflow"]["run_id"] == run_id
    (loss_file,) = (resumed_run.out_dir / "mlruns").glob(f"*/{run_id}/metrics/loss")
    steps = [int(line.split()[2]) for line in loss_file.read_text().splitlines()]
    assert steps == LOG_STEPS


def test_the_checkpoint_stores_the_tracker_state_a_resume_reuses(resumed_run):
    first, second = resumed_run.first_state, resumed_run.second_state
    assert second["tensorboard"]["logdir"] == first["tensorboard"]["logdir"]
    assert second["run_name"] == first["run_name"]
    step6 = find_checkpoint(resumed_run.out_dir / "checkpoints" / "6")
    assert read_metadata(step6)["trackers"] == first


def test_a_tracker_that_cannot_start_is_an_error_at_construction(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the event directory should go")
    with pytest.raises(TrackerError, match="tensorboard.*not a directory"):
        obs_trainer(out, report_to=["tensorboard"])

    # W&B online without credentials: the fix is named before anything is compiled.
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(TrackerError, match="wandb login.*WANDB_MODE=offline"):
        obs_trainer(tmp_path / "run2", report_to=["wandb"])
    assert issubclass(TrackerError, ArgumentError)  # the CLI reports it as bad input


def test_report_to_is_validated_and_parsed_from_the_command_line():
    with pytest.raises(ArgumentError, match="Did you mean 'tensorboard'"):
        TrainingArguments(report_to=["tensorbord"])
    args = TrainingArguments.from_dict({"report_to": "tensorboard,wandb"}, source="cli")
    assert args.report_to == ["tensorboard", "wandb"]
    assert TrainingArguments().report_to == ["jsonl"]


def test_every_tracker_holds_the_compile_records_in_the_run_it_opened(resumed_run):
    """Compiles are reported from a compile thread; MLflow's active run is per thread, so
    logging there through `mlflow.log_metrics` opened a second run that never ended."""
    from mlflow.tracking import MlflowClient

    run_id = resumed_run.first_state["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=(resumed_run.out_dir / "mlruns").as_uri())
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert [r.info.run_id for r in runs] == [run_id]  # one run, through the resume too
    (run,) = runs
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "compile/train_step_s")
    assert [m.step for m in history] == [0, 6]  # the first run's compile and the resume's
    assert all(m.value > 0 for m in history)
    assert run.data.params["max_steps"] == "12" and "loss" in run.data.metrics

    logdir = next((resumed_run.out_dir / "tensorboard").iterdir())
    scalars, _ = read_tensorboard(logdir)
    assert [s for s, _ in scalars["compile/train_step_s"]] == [0, 6]

    wandb_id = resumed_run.first_state["wandb"]["run_id"]
    wandb_runs = sorted((resumed_run.out_dir / "wandb").glob(f"offline-run-*-{wandb_id}"))
    assert wandb_runs
    compiles = [read_wandb_history(next(r.glob("*.wandb"))) for r in wandb_runs]
    assert [s for h in compiles for s, _ in h["compile/train_step_s"]] == [0, 6]
    assert [s for h in compiles for s, _ in h["loss"]] == LOG_STEPS


def test_project_name_names_the_mlflow_experiment_and_the_wandb_project(resumed_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(resumed_run.out_dir / "mlruns").as_uri())
    run = client.get_run(resumed_run.first_state["mlflow"]["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "obs-project"
    wandb_id = resumed_run.first_state["wandb"]["run_id"]
    run_dir = next((resumed_run.out_dir / "wandb").glob(f"offline-run-*-{wandb_id}"))
    projects = {
        record.run.project
        for record in read_wandb_records(next(run_dir.glob("*.wandb")))
        if record.WhichOneof("record_type") == "run"
    }
    assert projects == {"obs-project"}

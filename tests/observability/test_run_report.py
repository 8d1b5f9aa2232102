"""The run report: a real PNG whose curves are the logged values, and an HTML page."""

import numpy as np
import pytest
from matplotlib import image

from jaxtrain.cli import main
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.observability.monitor import RunMonitor
from jaxtrain.observability.progress import make_progress
from jaxtrain.observability.report import write_report
from jaxtrain.training.stopping import EXIT_BAD_INPUT


def test_the_run_wrote_its_report_at_the_end(resumed_run):
    assert (resumed_run.out_dir / "report.png").stat().st_size > 20_000
    assert (resumed_run.out_dir / "report.html").is_file()


def test_the_plotted_series_are_the_jsonl_values(resumed_run):
    report = write_report(resumed_run.out_dir)
    pixels = image.imread(report.png)
    assert pixels.shape[:2] == (850, 1500)
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    assert report.png.stat().st_size > 20_000
    records = read_jsonl(resumed_run.out_dir / "metrics.jsonl")
    for key in ("loss", "eval/loss", "learning_rate", "tokens_per_second", "mfu"):
        expected_steps = [r["step"] for r in records if key in r]
        expected = [r[key] for r in records if key in r]
        steps, values = report.series[key]
        assert steps == expected_steps and values == pytest.approx(expected)
    assert report.series["loss"][0] == [2, 4, 6, 8, 10, 12]
    assert report.series["eval/loss"][0] == [6, 12]
    summary = dict(report.summary)
    assert summary["steps"] == "12"
    last_loss = [r["loss"] for r in records if "loss" in r][-1]
    assert float(summary["final train loss"]) == pytest.approx(last_loss, rel=1e-3)
    assert summary["MFU (median)"].endswith("%")
    page = report.html.read_text()
    assert "data:image/png;base64," in page and "final eval loss" in page


def test_jaxtrain_report_command(resumed_run, tmp_path, capsys):
    assert main(["report", str(resumed_run.out_dir)]) == 0
    assert "report.png" in capsys.readouterr().out
    assert main(["report", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_progress_shows_epoch_loss_lr_tokens_and_eta(capsys):
    logs = {"step": 4, "epoch": 0.5, "loss": 2.5, "learning_rate": 1e-3}
    logs.update(tokens_per_second=1234.0, mfu=0.42)
    fields = RunMonitor.progress_fields(logs)
    assert fields == {"epoch": 0.5, "loss": 2.5, "lr": 1e-3, "tok/s": 1234.0, "mfu": "42.0%"}
    progress = make_progress("json", total=8)
    progress.update(4, fields)
    import json

    line = json.loads(capsys.readouterr().out)
    assert line["step"] == 4 and line["total"] == 8 and "eta_s" in line
    assert line["tok/s"] == 1234.0 and np.isfinite(line["eta_s"])


def test_a_report_that_cannot_be_written_is_an_error_after_the_checkpoint(tmp_path):
    from obs_helpers import obs_trainer

    from jaxtrain.checkpointing import checkpoints_root, committed_steps
    from jaxtrain.observability.report import ReportError

    out_dir = tmp_path / "run"
    (out_dir / "report.png").mkdir(parents=True)  # a directory where the PNG must go
    trainer = obs_trainer(
        out_dir, report_to=["jsonl"], weight_distribution_log_steps=None, max_steps=2
    )
    with pytest.raises(ReportError, match="jaxtrain report"):
        trainer.train()
    assert committed_steps(checkpoints_root(out_dir)) == [2]  # the training itself is kept


def test_a_log_whose_last_line_was_cut_still_reports(resumed_run, tmp_path, capsys):
    """A crash or a full disk mid-write leaves a last line cut short: `jaxtrain report` died
    with a JSONDecodeError traceback (exit 1); a bad line before the last is named."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(resumed_run.out_dir, run)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text + '{"step": 13, "loss": 1.')
    assert main(["report", str(run)]) == 0
    assert len(read_jsonl(run / "metrics.jsonl")) == len(text.splitlines())
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n' + text)
    assert main(["report", str(run)]) == EXIT_BAD_INPUT
    assert "metrics.jsonl line 1 is not JSON" in capsys.readouterr().err

"""A command's own process collects garbage less often (jaxtrain/cli/collector.py); a program
that calls `main([...])` keeps its own thresholds."""

import gc
import os
import subprocess
import sys
from pathlib import Path

from jaxtrain.cli import main
from jaxtrain.cli.collector import THRESHOLDS

PYTHON_DEFAULTS = (700, 10, 10)


def test_only_the_command_s_own_process_changes_the_thresholds(monkeypatch, capsys):
    kept = gc.get_threshold()
    gc.set_threshold(*PYTHON_DEFAULTS)
    try:
        assert main(["no-such-command"]) == 2  # called from a program: its collector is its own
        assert gc.get_threshold() == PYTHON_DEFAULTS
        monkeypatch.setattr(sys, "argv", ["jaxtrain", "no-such-command"])
        assert main() == 2  # the process's entry point
        assert gc.get_threshold() == THRESHOLDS != PYTHON_DEFAULTS
    finally:
        gc.set_threshold(*kept)
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_the_processes_the_tests_start_collect_as_the_commands_do():
    """tests/subprocess_site/sitecustomize.py gives every Python process a test starts the
    commands' thresholds (the scripts tests/parallel starts ran at Python's defaults)."""
    site = Path(__file__).with_name("subprocess_site")
    assert str(site) in os.environ["PYTHONPATH"].split(os.pathsep)
    shown = subprocess.run(
        [sys.executable, "-c", "import gc; print(*gc.get_threshold())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert tuple(map(int, shown.stdout.split())) == THRESHOLDS

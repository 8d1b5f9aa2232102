"""profile_steps writes a jax.profiler trace of exactly those steps; a step that runs out of
memory ends in one line with the compiled figures, settings that would fit and a device
memory profile.

One real `jaxtrain train` (tests/training/oom_worker.py) does both: it traces steps 1-2,
then the process may allocate only LIMIT_MIB more (RLIMIT_DATA, the worker's docstring
argues why this is a real out-of-memory on a CPU) and step 3's temporaries do not fit.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.errors import ArgumentError
from jaxtrain.observability.profiling import StepProfiler
from jaxtrain.observability.report import write_report

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
LIMIT_MIB = 100
EXIT_OUT_OF_MEMORY = 6
RUN = [
    "--max_steps", "4",
    "--warmup_steps", "1",
    "--total_batch_size", "64",
    "--max_sequence_length", "256",
    "--logging_steps", "1",
    "--evaluation_strategy", "no",
    "--save_final", "false",
    "--run_report", "false",
    "--progress_bar", "none",
    "--data.max_train_bytes", "100000",
    "--data.vocab_size", "384",
    "--model.hidden_size", "32",
    "--model.intermediate_size", "64",
    "--model.num_hidden_layers", "1",
    "--model.num_attention_heads", "2",
    "--model.num_key_value_heads", "1",
    "--sample.max_new_tokens", "0",
]  # fmt: skip


def limited_train(run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    """`jaxtrain train` whose process gets LIMIT_MIB more memory after step 2."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # One malloc arena: threads reserve no address space of their own under the limit.
    env.update(JAX_PLATFORMS="cpu", MALLOC_ARENA_MAX="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, str(HERE / "oom_worker.py"), "2", str(LIMIT_MIB), "train"]
    command += ["--output_dir", str(run_dir), *RUN, *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("profile_oom") / "run"
    return run_dir, limited_train(run_dir, "--profile_steps", "1-2")


def test_the_profile_holds_exactly_the_named_steps(run):
    run_dir, result = run
    info = json.loads((run_dir / "run_info.json").read_text())
    profile = info["profile"]  # the run's summary names it
    directory = run_dir.absolute() / "profile" / "process_0"
    assert profile["steps"] == [1, 2] and profile["directory"] == str(directory)
    # The run's log (its progress output, on stderr with progress_bar none) says where.
    assert f"jaxtrain: profile of steps 1-2 written to {directory}" in result.stderr
    # xprof / TensorBoard's file, read with JAX's own reader of the XSpace protobuf.
    spans, executions = {}, []
    for plane in jax.profiler.ProfileData.from_file(profile["xplane"]).planes:
        for line in plane.lines:
            for event in line.events:
                if event.name == "train":
                    step = int(dict(event.stats)["step_num"])
                    spans[step] = (event.start_ns, event.start_ns + event.duration_ns)
                elif event.name == "ThunkExecutor::Execute":  # XLA:CPU runs a program
                    executions.append(event.start_ns)
    assert sorted(spans) == [1, 2]  # the named steps, and no other
    # Each step's program ran inside the trace: an execution starts during or after the
    # step's span (dispatch is asynchronous) and before the next step's.
    assert any(spans[1][0] <= t < spans[2][0] for t in executions)
    assert any(t >= spans[2][0] for t in executions)
    # Perfetto's file holds the same spans.
    with gzip.open(profile["perfetto"]) as f:
        events = json.load(f)["traceEvents"]
    assert sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train") == [1, 2]
    # The report names it too (written here: the run ended on its out-of-memory step).
    assert ("profile (steps 1-2)", str(directory)) in write_report(run_dir).summary


def test_an_out_of_memory_step_is_one_line_with_settings_that_fit(run, tmp_path):
    run_dir, result = run
    assert result.returncode == EXIT_OUT_OF_MEMORY, result.stderr[-3000:]
    assert "limited after step 2" in result.stdout
    # One line, the last: the run's own lines come before it, no traceback.
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = lines[0]
    assert result.stderr.strip().splitlines()[-1] == line
    assert line.startswith(
        "jaxtrain train: error: the train step ran out of device memory after step 2 "
        "(RESOURCE_EXHAUSTED: Out of memory allocating "
    )
    # What the compiled step needs: the figure run_info.json recorded for the run's step.
    peak = json.loads((run_dir / "run_info.json").read_text())["train_step_memory"]["peak"]
    assert f"it needs {peak / 2**20:.1f} MiB per device" in line
    assert "one change each, compiled: not gradient_checkpointing=nothing_saveable" in line
    assert "more fsdp: no data-parallel devices to move (dp=1, fsdp=1)" in line
    profile = run_dir.absolute() / "memory_oom_process_0.prof"
    assert f"device memory profile: {profile} (pprof)" in line
    assert profile.read_bytes()[:2] == b"\x1f\x8b"  # pprof's gzip
    # The accumulation it names does fit: the same run with it, under the same limit, ends.
    found = re.search(r"; gradient_accumulation_steps=(\d+) \(micro-batch", line)
    assert found, line
    again = limited_train(tmp_path / "again", "--gradient_accumulation_steps", found.group(1))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "limited after step 2" in again.stdout and "done (completed)" in again.stdout


def test_profile_steps_are_read_and_checked():
    assert TrainingArguments(profile_steps="10-12").profile_steps == [10, 12]
    assert TrainingArguments(profile_steps="7").profile_steps == [7, 7]
    assert TrainingArguments(profile_steps=[3, 4]).profile_steps == [3, 4]
    assert TrainingArguments().profile_steps is None
    for bad in ("12-10", "0-2", "ten", [1, 2, 3]):
        with pytest.raises(ArgumentError, match=r"profile_steps=.* must be \[first, last\]"):
            TrainingArguments(profile_steps=bad)
    profiler = StepProfiler([10, 12], "/tmp/unused", 0)
    with pytest.raises(ArgumentError, match=r"ends after the run's last step \(8\)"):
        profiler.check_steps(0, 8)


def test_the_traced_steps_are_timed_as_the_others(tmp_path):
    """The trace ends once its last step is done. Waiting for that step before the previous
    window was read moved its time into that window and left its own nearly empty (in the
    run above, step 2 logged 0.06 s where step 1 took 3.5 s, and the empty window raised the
    stored CPU peak to 7.8 PFLOP/s); writing the trace is not step time either."""
    sys.path.insert(0, str(HERE))
    from tiny_run import tiny_model, tiny_trainer

    from jaxtrain.observability.logs import read_jsonl

    run_dir = tmp_path / "run"
    trainer = tiny_trainer(
        str(run_dir),
        model=tiny_model(hidden_size=256),  # steps long enough for the device to dominate
        total_batch_size=64,
        max_steps=7,
        logging_steps=1,
        profile_steps=[3, 4],
        run_report=False,
    )
    trainer.train()
    times = {
        r["step"]: r["step_time_s"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "step_time_s" in r
    }
    assert sorted(times) == [1, 2, 3, 4, 5, 6, 7]
    fastest = min(times[s] for s in (2, 5, 6, 7))
    # A traced step runs slower (the profiler records every Python call), never much faster;
    # the bug left a traced step's window nearly empty (1/60 of the others). The bound is
    # loose: another process on the machine (a parallel test worker) moves step times 2-3x.
    assert times[3] > 0.25 * fastest and times[4] > 0.25 * fastest, times
    assert (run_dir / "profile" / "process_0").is_dir()

"""Real Ray, real processes: actors forming one JAX cluster, faults and restarts.

One local Ray instance serves the whole module. Each run trains a tiny Llama with SGD on a
mesh of 8 CPU devices: one actor with 8 devices, or two actors with 4 each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from jaxtrain import TrainingArguments  # noqa: E402
from jaxtrain.distributed import ClusterConfig, ClusterError, RayDistributedTrainer  # noqa: E402

VOCAB, SEQ = 64, 16
MODEL = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


class RecordingRows(list):
    """A list-of-dicts dataset that remembers which rows this process's training read (the
    loader's prefetch thread; validation peeks happen on the caller's thread)."""

    read: list[int]

    def __getitem__(self, index):
        if isinstance(index, int) and threading.current_thread().name == "jaxtrain-prefetch":
            self.__dict__.setdefault("read", []).append(index)
        return super().__getitem__(index)


class ReportReads:
    """In every process: write what training read."""

    def __init__(self, rows: RecordingRows, out_dir: str) -> None:
        self.rows, self.out_dir = rows, out_dir

    def on_train_end(self, trainer, output) -> None:
        import jax

        loader = trainer.train_source.loader
        steps = int(output.state.step)  # the run went to its last step
        result = {
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(),
            "global_devices": jax.device_count(),
            "rows_read": self.rows.read,
            "global_indices": [loader.global_indices(s).tolist() for s in range(steps)],
            "pid": os.getpid(),
        }
        Path(self.out_dir, f"process_{jax.process_index()}.json").write_text(json.dumps(result))


class KillSelf:
    """Process `victim` SIGKILLs itself before step `at_step` (once `wait_for` is committed),
    or when training starts (`at_step=None`), on the first attempt only (a marker file
    remembers) or on every attempt."""

    def __init__(
        self,
        victim: int,
        at_step: int,
        marker: str,
        wait_for: str | None = None,
        every_attempt: bool = False,
    ) -> None:
        self.victim, self.at_step, self.marker = victim, at_step, marker
        self.wait_for, self.every_attempt = wait_for, every_attempt

    def on_step_start(self, trainer, state, step) -> None:
        import jax

        if jax.process_index() != self.victim or step != self.at_step:
            return
        self.kill()

    def on_train_start(self, trainer, state) -> None:
        import jax

        if self.at_step is None and jax.process_index() == self.victim:
            self.kill()

    def kill(self) -> None:
        if os.path.exists(self.marker) and not self.every_attempt:
            return
        Path(self.marker).write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while self.wait_for and not os.path.isdir(self.wait_for):
            assert time.monotonic() < deadline, f"{self.wait_for} was never committed"
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)


class TermSelf:
    """Process `victim` is sent SIGTERM (as a preempted node's process is) at step `at_step`."""

    def __init__(self, victim: int, at_step: int) -> None:
        self.victim, self.at_step = victim, at_step

    def on_step_start(self, trainer, state, step) -> None:
        import jax

        if jax.process_index() == self.victim and step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


class Listener:
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.starts: list[int] = []
        self.saves: list[int] = []
        self.restarts: list[dict] = []

    def on_train_start(self, trainer, step) -> None:
        self.starts.append(step)

    def on_log(self, trainer, logs, step) -> None:
        self.losses.append(float(logs["loss"]))

    def on_save(self, trainer, path, step) -> None:
        self.saves.append(step)

    def on_restart(self, trainer, info) -> None:
        self.restarts.append(info)


def rows(n: int = 64) -> RecordingRows:
    rng = np.random.default_rng(0)
    return RecordingRows(
        [
            {"input_ids": rng.integers(1, VOCAB - 1, size=int(k)).tolist()}
            for k in rng.integers(4, SEQ + 1, size=n)
        ]
    )


def arguments(output_dir: Path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(output_dir),
        optimizer="sgd",
        learning_rate=0.5,
        scheduler="constant",
        max_steps=4,
        total_batch_size=16,
        max_sequence_length=SEQ,
        logging_steps=1,
        evaluation_strategy="no",
        save_steps=2,
        progress_bar="none",
        run_report=False,
        seed=3,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def trainer() -> RayDistributedTrainer:
    return RayDistributedTrainer(
        MODEL,
        config_scaling_variables={"hidden_size": 16, "intermediate_size": 32},
        # dp2 x fsdp2 x tp2: data, parameters and heads are all split over the 8 devices.
        config_variables={"sharding_axis_dims": (2, 2, 1, 2, 1), "seed": 5},
    )


def two_processes(**overrides) -> ClusterConfig:
    values = dict(
        num_processes=2,
        devices_per_process=4,
        cpus_per_process=1,
        teardown_timeout_s=30,
        start_timeout_s=120,
    )
    values.update(overrides)
    return ClusterConfig(**values)


def params_of(output) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(output.state.params)]


def all_pids(attempts) -> list[int]:
    return [p["pid"] for a in attempts for p in a.processes]


def gone(pids: list[int], within_s: float = 10.0) -> bool:
    import psutil

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def ray_session():
    from ray import cloudpickle

    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="jtray", dir="/tmp")  # short: Ray puts sockets there
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    ray.init(include_dashboard=False, num_cpus=2, _temp_dir=temp, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """The same training on one process with 8 devices and on two with 4 each."""
    out = {}
    for name, cluster in [
        ("one", ClusterConfig(num_processes=1, devices_per_process=8)),
        ("two", two_processes()),
    ]:
        tmp = tmp_path_factory.mktemp(name)
        data, listener, rt = rows(), Listener(), trainer()
        output = rt.train(
            2,
            arguments(tmp / "run"),
            data,
            callbacks=[ReportReads(data, str(tmp))],
            listeners=[listener],
            cluster=cluster,
        )
        out[name] = dict(output=output, listener=listener, attempts=rt.attempts, tmp=tmp)
    return out


def test_two_actors_train_like_one_process_and_read_only_their_half(runs):
    one, two = runs["one"], runs["two"]
    assert len(one["listener"].losses) == len(two["listener"].losses) == 4
    np.testing.assert_allclose(two["listener"].losses, one["listener"].losses, rtol=1e-5)
    for a, b in zip(params_of(two["output"]), params_of(one["output"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert two["output"].checkpoint_path.endswith("checkpoints/4")
    assert two["listener"].saves == [2, 4] and two["listener"].starts == [0]
    for i in range(2):
        r = json.loads((two["tmp"] / f"process_{i}.json").read_text())
        assert (r["process_index"], r["process_count"]) == (i, 2)
        assert (r["local_devices"], r["global_devices"]) == (4, 8)
        # Exactly this process's half of every global batch of 16 rows, in order.
        mine = [row for g in r["global_indices"] for row in g[0][i * 8 : (i + 1) * 8]]
        assert r["rows_read"][: len(mine)] == mine and len(mine) == 4 * 8
    # Both attempts' processes were torn down once the run was over.
    assert len(two["attempts"]) == 1 and gone(all_pids(two["attempts"]))


def test_sigkilled_actor_restarts_from_the_checkpoint_and_ends_like_no_fault(runs, tmp_path):
    run = tmp_path / "run"
    data, listener, rt = rows(), Listener(), trainer()
    kill = KillSelf(1, 3, str(tmp_path / "killed"), wait_for=str(run / "checkpoints" / "2"))
    output = rt.train(
        2,
        arguments(run),
        data,
        callbacks=[kill],
        listeners=[listener],
        cluster=two_processes(max_restarts=1),
    )
    assert len(rt.attempts) == 2
    first = rt.attempts[0]
    assert first.failed_process == 1 and "died" in first.cause.lower() or "exit" in first.cause
    assert first.processes[1]["pid"] == int((tmp_path / "killed").read_text())
    assert listener.restarts == [{"attempt": 0, "process": 1}]
    assert listener.starts == [0, 2]  # the second attempt resumed the step-2 checkpoint
    reference = params_of(runs["two"]["output"])
    for a, b in zip(params_of(output), reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert gone(all_pids(rt.attempts))


def test_exhausted_restarts_raise_an_error_naming_the_dead_process(ray_session, tmp_path):
    data, rt = rows(), trainer()
    kill = KillSelf(1, None, str(tmp_path / "killed"), every_attempt=True)
    with pytest.raises(ClusterError, match=r"process 1 of 2 \(pid \d+ on node .*\) died") as err:
        rt.train(
            2,
            arguments(tmp_path / "run"),
            data,
            callbacks=[kill],
            cluster=two_processes(max_restarts=0),
        )
    assert "max_restarts=0 is exhausted" in str(err.value)
    assert len(rt.attempts) == 1 and rt.attempts[0].failed_process == 1
    assert gone(all_pids(rt.attempts))


def test_cli_launch_runs_jaxtrain_train_as_one_cluster_of_actors(ray_session, tmp_path, capsys):
    from jaxtrain.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(32)))
    config = {
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
        "total_batch_size": 8,
        "max_sequence_length": SEQ,
        "evaluation_strategy": "no",
        "warmup_steps": 0,
        "progress_bar": "none",
        "run_report": False,
        # dp=4 needs the devices of both processes: alone, one has only 2.
        "sharding_axis_dims": [4, 1, 1, 1, 1],
        "model": {**MODEL, "max_position_embeddings": 64},
        "data": {"source": "files", "train_files": str(data)},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    command = ["launch", "--ray", "--num_processes", "2", "--devices_per_process", "2"]
    assert main([*command, "train", str(path), "--logging_steps", "1"]) == 0
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
    logged = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2]  # written once, by process 0
    assert "attempt 0: 2 processes (0: pid" in capsys.readouterr().out


def exit_code_by_process(tokens: list[str]) -> int:
    """A command whose exit code is 3 on process 1 only (as a failure on one host)."""
    return 3 if os.environ["JAXTRAIN_PROCESS_ID"] == "1" else 0


def test_launch_fails_when_any_process_fails(ray_session, capsys):
    from jaxtrain.distributed.launch import launch_ray

    code = launch_ray(["train"], two_processes(max_restarts=0), exit_code_by_process)
    assert code == 3
    assert "non-zero exit codes (process 1: 3)" in capsys.readouterr().out


def die_on_process_one(tokens: list[str]) -> int:
    """A command whose process 1 is killed (as the OOM killer or a lost node would)."""
    if os.environ["JAXTRAIN_PROCESS_ID"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_death_with_no_restart_left_is_exit_5_in_one_readable_line(ray_session, capsys):
    """It said "process 1 died; restarting" and did not restart, ended with exit 2 (bad
    input), and quoted Ray's reason cut mid-word."""
    from jaxtrain.distributed.launch import launch_ray
    from jaxtrain.errors import EXIT_PEER_LOST

    with pytest.raises(ClusterError, match=r"process 1 of 2 .* died") as err:
        launch_ray(["train"], two_processes(max_restarts=0), die_on_process_one)
    assert err.value.exit_code == EXIT_PEER_LOST
    assert "restarting" not in capsys.readouterr().out
    message = str(err.value)
    cause = message.split(" died: ", 1)[1].split(". The job ran ", 1)[0]
    assert len(message.splitlines()) == 1 and len(cause) < 260 and ".." not in message, message


def test_sigterm_to_one_process_stops_every_process_at_one_step_with_a_save(ray_session, tmp_path):
    """A Ray actor's job runs off its process's main thread, where no handler was installed:
    SIGTERM to one process was ignored and the run trained to its end."""
    from jaxtrain.errors import TrainingInterrupted

    rt = trainer()
    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as stopped:
        rt.train(2, arguments(run, max_steps=40, save_steps=100), rows(),
                 callbacks=[TermSelf(1, 3)], cluster=two_processes())  # fmt: skip
    # JAX's preemption sync picks the step every process stops at; that step is saved.
    step = stopped.value.step
    assert stopped.value.signal_name == "SIGTERM" and 3 <= step < 40
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()] == [str(step)]
    assert len(rt.attempts) == 1  # a stop, not a death: nothing restarted


def test_ctrl_c_to_the_launch_driver_saves_on_every_process_and_exits_130(tmp_path):
    """It was a KeyboardInterrupt traceback through ray.wait, exit 1, and no checkpoint."""
    import subprocess

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(32)))
    run = tmp_path / "run"
    config = {
        "output_dir": str(run), "max_steps": 3000, "save_steps": 5000, "total_batch_size": 8,
        "max_sequence_length": SEQ, "evaluation_strategy": "no", "warmup_steps": 0,
        "progress_bar": "none", "run_report": False, "logging_steps": 1,
        "model": {**MODEL, "max_position_embeddings": 64},
        "data": {"source": "files", "train_files": str(data)}, "sample": {"max_new_tokens": 0},
    }  # fmt: skip
    (tmp_path / "cfg.yaml").write_text(json.dumps(config))
    command = [sys.executable, "-m", "jaxtrain.cli", "launch", "--ray", "--num_processes", "2",
               "--devices_per_process", "1", "train", str(tmp_path / "cfg.yaml")]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled"}
    driver = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not (run / "metrics.jsonl").is_file()
            or "loss" not in (run / "metrics.jsonl").read_text()
        ):
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()
            time.sleep(0.2)
        driver.send_signal(signal.SIGINT)
        stdout, stderr = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130, stderr[-3000:]
    assert "SIGINT: every process saves after its step and stops" in stdout
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "\x1b[" not in stdout + stderr  # not a terminal: no colour codes (Ray's dedup marker)
    saved = [p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and int(saved[0]) < 3000

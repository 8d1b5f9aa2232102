"""GRPO on a mesh: an update on a 4-device dp=2 x fsdp=2 mesh equals one device's
(num_iterations 2: the second update uses the old log-probs and the clip; beta > 0), a resume
inside a round is exact, and two processes generating their shares train like one."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from common import run_worker, worker_env

HERE = Path(__file__).parent
# Logged values that measure time or speed: the only ones two runs may differ in.
TIMED = ("_s", "_fraction", "per_second", "per_device", "mfu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dp_fsdp_mesh_gives_the_update_of_one_device(tmp_path):
    info = run_worker("grpo_worker.py", str(tmp_path))
    assert info["single"] == {"devices": 1, "sharded": False, "steps": 2}
    assert info["dp2_fsdp2"] == {"devices": 4, "sharded": True, "steps": 2}
    one, mesh = np.load(tmp_path / "single.npz"), np.load(tmp_path / "dp2_fsdp2.npz")
    assert sorted(one.files) == sorted(mesh.files)
    for key in one.files:  # "<update>_<leaf>": after each of the two updates
        np.testing.assert_allclose(mesh[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    second = [k for k in one.files if k.startswith("1_")]
    # The second update (on the old log-probs) moved the parameters: not a vacuous match.
    assert any(not np.allclose(one[k], one["0_" + k[2:]]) for k in second)


def test_a_resume_inside_a_round_on_the_mesh_is_exact(tmp_path):
    """Stopped inside a round on a dp=2 x fsdp=2 mesh and resumed: the checkpoint's round
    batch comes back sharded like the generated one, and the run ends bit-equal."""
    info = run_worker("grpo_resume_worker.py", str(tmp_path))
    assert "extra" in info["extra"], info  # the save at step 3 kept the round's batch
    assert info["steps"] == [4] and info["same_completions"], info
    assert info["batch"] == info["batch_whole"] and info["batch"][0] == 4, info
    whole, resumed = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    for key in whole.files:
        np.testing.assert_array_equal(resumed[key], whole[key], err_msg=key)


def test_two_processes_each_generating_their_share_train_like_one(tmp_path):
    """Two real JAX processes (2 CPU devices each) of one dp=2 x fsdp=2 run: each samples its
    rows of every micro-batch on an engine over its own copy of the policy. The completions,
    every logged value, the evaluation (3 prompts: shares of 2 and 1) and the final parameters
    equal one process's on the same mesh shape (temperature 0.7, num_iterations 2, 2
    micro-batches, beta > 0, LoRA: the base is gathered once, the adapters every round); a
    two-process run stopped inside a round resumes exactly."""
    worker = [sys.executable, str(HERE / "grpo_processes_worker.py"), str(tmp_path)]
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [*worker, "two", port, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env(),
        )
        for i in range(2)
    ]
    one = subprocess.run([*worker, "one"], capture_output=True, text=True, env=worker_env())
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert one.returncode == 0, one.stderr[-3000:]
    single = json.loads((tmp_path / "one.json").read_text())
    assert single["processes"] == 1 and single["local_devices"] == 4
    single_params = np.load(tmp_path / "one.npz")
    for i in range(2):
        two = json.loads((tmp_path / f"two_{i}.json").read_text())
        assert two["processes"] == 2 and two["local_devices"] == 2
        assert two["engine_devices"] == 2  # the engine ran on this process's devices only
        assert two["rounds"] == single["rounds"]  # every completion of every round
        assert [x["step"] for x in two["logs"]] == [x["step"] for x in single["logs"]]
        for mine, theirs in zip(two["logs"], single["logs"]):
            assert mine.keys() == theirs.keys()
            for key in sorted(k for k in mine if not k.endswith(TIMED)):
                # atol: a GRPO loss of a round's first update sums advantages that cancel, so
                # it is ~0 (5e-9 vs 0.0 seen), where two processes' summation order shows.
                # The sampler/trainer difference is float rounding itself (~2e-6): it differs
                # with the devices' layout, and both are ~0.
                atol = 1e-5 if key.startswith("sampling/") else 1e-7
                np.testing.assert_allclose(
                    mine[key], theirs[key], rtol=1e-5, atol=atol, err_msg=key
                )
        assert len(two["evals"]) == 2
        for mine, theirs in zip(two["evals"], single["evals"]):
            assert mine == theirs
        params = np.load(tmp_path / f"two_{i}.npz")
        for key in single_params.files:
            np.testing.assert_allclose(params[key], single_params[key], rtol=1e-5, atol=1e-6)
        # Stopped inside a round and resumed: bit-equal to the uninterrupted two-process run,
        # and the restored round's host rows are this process's half of each micro-batch.
        resumed = np.load(tmp_path / f"resumed_{i}.npz")
        for key in params.files:
            np.testing.assert_array_equal(resumed[key], params[key], err_msg=key)
        assert two["restored_rows_are_this_process_rows"]
        assert two["local_rows"] == [2, 4, 12]  # [A, M / 2, prompt + completion]
    # Not a vacuous match: the rounds differ, and the evaluation scored something.
    assert len({x["reward"] for x in single["logs"]}) > 1
    assert all(e["eval/reward"] > 0 for e in single["evals"])


def test_an_engine_on_devices_of_its_own_samples_what_the_training_mesh_would(tmp_path):
    """rollout_devices=2 of 4: training on the first two, the engine on the last two (the
    policy copied there each round), asynchronous (max_staleness 1). The completions and the
    final parameters are those of the same run sampling on its training devices."""
    info = run_worker("grpo_rollout_mesh_worker.py", str(tmp_path))
    split, plain = info["split"], info["plain"]
    assert split["train_devices"] == [0, 1] and split["engine_devices"] == [2, 3]
    assert plain["engine_devices"] == [0, 1]
    assert split["completions"] == plain["completions"] and len(split["completions"]) == 3
    a, b = np.load(tmp_path / "split.npz"), np.load(tmp_path / "plain.npz")
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)

"""Parallelism on 8 CPU devices (XLA_FLAGS, in subprocesses) and in two real JAX processes.

One worker subprocess (`mesh_worker.py`) pays the JAX import and runs every single-process
check; `multihost_worker.py` runs twice, as the two processes of a JAX cluster.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from common import MESHES, worker_env

from jaxtrain import TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import RuntimeSettings
from jaxtrain.parallel import MeshError, detect_cluster, resolve_axis_dims

HERE = Path(__file__).parent
# `jaxtrain train` at a tiny size: 2 steps, an eval and a short sample.
TINY_CLI = [
    "--max_steps", "2", "--warmup_steps", "0", "--total_batch_size", "4",
    "--max_sequence_length", "32", "--logging_steps", "1", "--eval_steps", "2",
    "--max_eval_batches", "1", "--data.max_train_bytes", "200000", "--data.vocab_size", "384",
    "--model.hidden_size", "32", "--model.intermediate_size", "64",
    "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
    "--model.num_key_value_heads", "1", "--sample.max_new_tokens", "4",
    "--distributed_timeout_s", "120",
]  # fmt: skip
TOL = 1e-6  # float32: reductions in another order differ by a few ulps


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("meshes")
    proc = subprocess.run(
        [sys.executable, str(HERE / "mesh_worker.py"), str(out)],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def test_every_mesh_trains_like_one_device(mesh_results):
    runs = mesh_results["runs"]
    single = runs["single"]["losses"]
    # TFLOP/s and MFU divide by the mesh's devices, not every device the process has.
    assert runs["single"]["run_info_num_devices"] == 1
    assert len(single) == 3
    for name in ("dp8", "fsdp8", "dp2_fsdp2_tp2", "fsdp4_sp2"):
        assert runs[name]["num_devices_used"] == 8, name
        assert runs[name]["run_info_num_devices"] == 8, name
        assert tuple(runs[name]["mesh"]) == MESHES[name], name  # TrainerOutput.mesh
        np.testing.assert_allclose(runs[name]["losses"], single, rtol=TOL, err_msg=name)
        assert runs[name]["max_param_diff"] < TOL, (name, runs[name]["max_param_diff"])
    # Evaluation on sharded eval batches (with a padded last batch) is exact too.
    assert runs["single"]["eval_loss"] is not None
    np.testing.assert_allclose(
        runs["dp2_fsdp2_tp2"]["eval_loss"], runs["single"]["eval_loss"], rtol=TOL
    )


def test_parameters_and_optimizer_state_are_really_sharded(mesh_results):
    runs = mesh_results["runs"]
    for path, (full, shard) in runs["fsdp8"]["shards"].items():
        # fsdp=8 splits exactly one dimension (the largest divisible one) by 8.
        ratios = [f // s for f, s in zip(full, shard, strict=True)]
        assert sorted(ratios)[-1] == 8 and np.prod(ratios) == 8, (path, full, shard)
    qkv = runs["dp2_fsdp2_tp2"]["shards"][
        "['model']['layers'][0]['self_attn']['qkv_proj']['kernel'].value"
    ]
    assert qkv == [[32, 2, 4, 8], [16, 1, 4, 8]]  # embed over fsdp, kv_heads over tp
    assert runs["single"]["shards"]["['lm_head']['kernel'].value"] == [[32, 64], [32, 64]]
    # Adam's moments follow their parameters (ZeRO); dp replicates everything.
    assert any("fsdp" in spec for spec in runs["fsdp8"]["opt_shards"])
    assert all("fsdp" not in spec for spec in runs["dp8"]["opt_shards"])


def test_sharded_init_never_builds_an_unsharded_copy(mesh_results):
    run = mesh_results["runs"]["fsdp8"]
    assert mesh_results["abstract_before_train"]  # the factory's model is shapes only
    assert run["init_out_shardings_match"]
    total = run["init_total_state_bytes"]
    # Each device outputs its 1/8 of the state (plus replicated scalars) and never needs a
    # scratch buffer as large as the parameters (a third of the state).
    assert run["init_output_bytes_per_device"] < total / 8 * 1.05
    assert run["init_temp_bytes_per_device"] < total / 3


def test_data_parallel_step_has_no_parameter_all_gather(mesh_results):
    run = mesh_results["runs"]["dp8"]
    assert run["hlo_all_gather"] == 0
    assert run["hlo_all_reduce"] > 0  # the gradient reduction


def test_resume_on_a_different_mesh_continues_exactly(mesh_results):
    # Saved at step 2 on 8 devices (fsdp=8), resumed on 4 (dp=2, fsdp=2): resharded on load.
    run = mesh_results["runs"]["resume_dp2_fsdp2"]
    assert run["step"] == 3 and run["devices"] == 4
    assert run["max_param_diff"] < TOL, run["max_param_diff"]


def test_rules_that_do_not_fit_name_parameter_shape_and_axes(mesh_results):
    errors = mesh_results["rule_errors"]
    tp = errors["tp8_kv_heads"]
    assert tp.startswith("ShardingRuleError") and "o_proj/kernel" in tp
    assert "(4, 8, 32)" in tp and "'tp'" in tp and "size 8" in tp
    assert (
        "gives 2 entries" in errors["regex_bad"] and "input_layernorm/weight" in errors["regex_bad"]
    )
    assert mesh_results["sharding_for"] == "P('tp', 'fsdp')"


def test_user_rules_regex_rules_and_models_without_logical_axes(mesh_results):
    specs = mesh_results["rule_specs"]  # mesh fsdp=4, tp=2; down_proj (64, 32) (mlp, embed)
    assert specs["default"] == "P('tp', 'fsdp')"
    assert specs["mlp_on_fsdp"] == "P('fsdp', 'tp')"
    assert specs["regex"] == "P(None, ('fsdp', 'tp'))"
    assert specs["no_axes_custom"] == "P(None, 'fsdp')"  # fsdp alone: the largest dimension


def test_model_factory_creates_a_sharded_model_equal_to_eager_init(mesh_results):
    made = mesh_results["factory_create"]
    assert made["max_diff"] < TOL  # jit vs eager initialisers: the same numbers
    assert made["sharded_leaves"] == made["leaves"]


def test_dry_run_prints_mesh_memory_and_every_parameter(mesh_results):
    text = mesh_results["dry_run"]
    assert "mesh(dp=1, fsdp=8, ep=1, tp=1, sp=1) over 8 x cpu" in text
    for key in ("parameters", "gradients", "optimizer state", "activations"):
        assert f"  {key}" in text
    assert "model/layers/0/self_attn/qkv_proj/kernel" in text
    assert "('fsdp', None, None, None)  (4, 2, 4, 8)" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_processes(tmp_path: Path, *mode: str) -> list[dict]:
    """Run multihost_worker.py as processes 0 and 1 of one cluster; their JSON results."""
    command = [sys.executable, str(HERE / "multihost_worker.py"), str(_free_port())]
    procs = [
        subprocess.Popen(
            [*command, str(i), str(tmp_path), *mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env(),
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    prefix = f"{mode[0]}_" if mode else "process_"
    return [json.loads((tmp_path / f"{prefix}{i}.json").read_text()) for i in range(2)]


def test_two_processes_train_like_one_and_read_only_their_rows(tmp_path, mesh_results):
    results = _run_two_processes(tmp_path)
    expected = mesh_results["runs"]["dp2_fsdp2_tp2"]["losses"]  # one process, 8 devices
    for i, r in enumerate(results):
        assert (r["process_index"], r["process_count"]) == (i, 2)
        assert (r["local_devices"], r["global_devices"]) == (4, 8)
        np.testing.assert_allclose(r["losses"], expected, rtol=TOL)
        eval_expected = mesh_results["runs"]["dp2_fsdp2_tp2"]["eval_loss"]
        np.testing.assert_allclose(r["eval_loss"], eval_expected, rtol=TOL)
        assert r["local_batch_shape"] == [1, 8, 16]  # half of the 16-row global batch
        # The rows read are exactly this process's half of every global batch, in order.
        mine = [row for g in r["global_indices"] for row in g[0][i * 8 : (i + 1) * 8]]
        assert r["rows_read"] == mine and len(mine) >= 3 * 8
        assert r["checkpoint"].endswith("checkpoints/3")
    assert (tmp_path / "run" / "checkpoints" / "3").is_dir()
    # Only process 0 writes the metric log.
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_two_processes_resume_packed_data_from_each_process_position(tmp_path):
    results = _run_two_processes(tmp_path, "packed")
    state = results[0]["data_state"]
    # The checkpoint holds both processes' positions, each in its own share of the data.
    assert state["step"] == 2 and len(state["processes"]) == 2
    assert [p["process_index"] for p in state["processes"]] == [0, 1]
    for r in results:
        assert len(r["straight"]) == 4 and len(r["resumed"]) == 2
        # Steps 3 and 4 after the resume see exactly the rows of the uninterrupted run.
        np.testing.assert_allclose(r["resumed"], r["straight"][2:], rtol=TOL)


def test_only_process_0_speaks_in_a_two_process_command_line_run(tmp_path):
    # Issue 41: under --progress_bar json process 1 printed its start, compile, eval and done
    # lines in plain text; as under Ray, only process 0 speaks for the run.
    command = [sys.executable, "-m", "jaxtrain.cli", "train", "--output_dir", str(tmp_path)]
    command += [*TINY_CLI, "--progress_bar", "json", "--num_processes", "2"]
    command += ["--coordinator_address", f"127.0.0.1:{_free_port()}"]
    env = {
        **worker_env(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1",
    }
    procs = [
        subprocess.Popen(
            [*command, "--process_id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    (out0, err0), (out1, err1) = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], err0[-2000:] + err1[-2000:]
    spoken = ("jaxtrain:", "compiled", "eval loss", "done (completed)", "--- sample")
    assert all(line in out0 + err0 for line in spoken), out0 + err0
    # Gloo (JAX's CPU collectives, C++) announces its connection on stdout itself.
    assert [line for line in out1.splitlines() if not line.startswith("[Gloo]")] == [], out1
    assert not [line for line in spoken if line in err1], err1


def test_processes_given_different_arguments_are_refused_on_every_process(tmp_path):
    """Process 1 with another learning rate trained its shards with it, and both said
    "done (completed)"."""
    command = [sys.executable, "-m", "jaxtrain.cli", "train", "--output_dir", str(tmp_path)]
    command += [*TINY_CLI, "--num_processes", "2"]
    command += ["--coordinator_address", f"127.0.0.1:{_free_port()}"]
    env = {
        **worker_env(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1",
    }
    own = [[], ["--learning_rate", "0.05"]]
    procs = [
        subprocess.Popen([*command, "--process_id", str(i), *own[i]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for i in range(2)
    ]  # fmt: skip
    errors = [p.communicate(timeout=300)[1] for p in procs]
    # The same error on every process is said once in full (parallel/peers.py): the process
    # that ends second may name the first instead (exit 5).
    codes = sorted(p.returncode for p in procs)
    assert codes in ([2, 2], [2, 5]), errors
    said = "the 2 processes of this run were given different arguments (learning_rate: process"
    assert any(said in err and "process 1 0.05" in err for err in errors), errors
    assert not any("Traceback" in err for err in errors), errors


def test_missing_peer_fails_with_a_clear_error_and_exit_code_2():
    command = [sys.executable, "-m", "jaxtrain.cli", "train", "--coordinator_address"]
    command += [f"127.0.0.1:{_free_port()}", "--num_processes", "2", "--process_id", "1"]
    command += ["--distributed_timeout_s", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, env=worker_env(), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "did not complete within distributed_timeout_s=2s" in proc.stderr
    assert "process 1 of 2" in proc.stderr


@pytest.mark.parametrize(
    "dims, message",
    [
        ((2, 2, 1, 1, 1), "multiplies to 4 devices, but 8 are available"),
        ((1, -1, 1, 1, -1), "only one axis may take"),
        ((3, -1, 1, 1, 1), "does not divide the 8 devices"),
        ((1, 8, 1, 1), "exactly 5 integers"),
        ((1, 0, 1, 1, 1), "positive size or -1"),
    ],
)
def test_bad_meshes_fail_early_with_clear_messages(dims, message):
    with pytest.raises(MeshError, match=message):
        resolve_axis_dims(dims, 8)


def test_axis_dims_resolve_and_parse_from_the_command_line():
    assert resolve_axis_dims((2, -1, 1, 2, 1), 8) == (2, 2, 1, 2, 1)
    args = TrainingArguments.from_dict(
        {"sharding_axis_dims": "2,-1,1,1,1", "sharding_rules": "{mlp: tp, embed: fsdp}"},
        source="command line",
    )
    assert args.sharding_axis_dims == (2, -1, 1, 1, 1)
    assert args.sharding_rules == {"mlp": "tp", "embed": "fsdp"}
    with pytest.raises(ArgumentError, match="not a mesh axis|use a mesh axis"):
        TrainingArguments(sharding_rules={"mlp": "model"})
    with pytest.raises(ArgumentError, match="distributed"):
        TrainingArguments(distributed="maybe")


def test_cluster_detection_from_arguments_and_environment():
    args = RuntimeSettings.from_arguments(TrainingArguments())
    assert detect_cluster(args, env={}) is None
    assert detect_cluster(args, env={"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}) is None
    assert detect_cluster(args, env={"SLURM_JOB_ID": "1", "SLURM_NTASKS": "4"}).source == "slurm"
    assert detect_cluster(args, env={"TPU_WORKER_HOSTNAMES": "a,b"}).source == "tpu"
    env = {
        "JAXTRAIN_COORDINATOR_ADDRESS": "10.0.0.1:1234",
        "JAXTRAIN_NUM_PROCESSES": "2",
        "JAXTRAIN_PROCESS_ID": "1",
    }
    spec = detect_cluster(args, env=env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == (
        "10.0.0.1:1234",
        2,
        1,
    )
    explicit = RuntimeSettings.from_arguments(
        TrainingArguments(coordinator_address="h:1", num_processes=2, process_id=0)
    )
    assert detect_cluster(explicit, env=env).source == "arguments"


def test_cli_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    env = {
        **worker_env(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
    }
    command = [sys.executable, "-m", "jaxtrain.cli", "train", "--dry_run"]
    command += ["--sharding_axis_dims", "2,2,1,2,1", "--output_dir", str(tmp_path / "run")]
    command += ["--total_batch_size", "8", "--max_sequence_length", "32"]
    command += ["--data.max_train_bytes", "200000", "--data.vocab_size", "384"]
    command += ["--model.hidden_size", "32", "--model.intermediate_size", "64"]
    command += ["--model.num_hidden_layers", "1", "--model.num_attention_heads", "2"]
    command += ["--model.num_key_value_heads", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh(dp=2, fsdp=2, ep=1, tp=2, sp=1) over 8 x cpu" in proc.stdout
    assert "model/layers/0/self_attn/qkv_proj/kernel" in proc.stdout
    assert "('fsdp', 'tp', None, None)" in proc.stdout
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written

"""SLURM: the task's cluster settings from SLURM's variables, and the sbatch script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxtrain import TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import RuntimeSettings
from jaxtrain.distributed.slurm import SbatchOptions, sbatch_script
from jaxtrain.parallel import detect_cluster
from jaxtrain.parallel.slurm_env import PORT_BASE, expand_nodelist, slurm_task


def test_node_lists_expand_in_order_with_their_zero_padding():
    assert expand_nodelist("node[01-03,07],gpu5") == [
        "node01",
        "node02",
        "node03",
        "node07",
        "gpu5",
    ]
    assert expand_nodelist("a[008-010]-ib") == ["a008-ib", "a009-ib", "a010-ib"]
    assert expand_nodelist("single") == ["single"]
    with pytest.raises(ArgumentError, match="cannot read range 'x-2'"):
        expand_nodelist("n[x-2]")


def test_a_name_of_several_ranges_expands_as_scontrol_does():
    """The second range of a name was copied as text: every task's coordinator was
    'rack1-node[01-02]', no host, and the cluster never formed."""
    assert expand_nodelist("rack[1-2]-node[01-02],gpu7") == [
        "rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02", "gpu7",
    ]  # fmt: skip
    for bad in ("n[1-2", "n]1", "a,,b"):
        with pytest.raises(ArgumentError, match="unbalanced brackets or empty names"):
            expand_nodelist(bad)


def slurm_env(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-10]",
    }
    env.update(extra)
    return env


def test_a_task_reads_its_rank_count_and_the_first_node_as_coordinator():
    task = slurm_task(slurm_env())
    assert (task.num_processes, task.process_id, task.local_id) == (4, 2, 0)
    assert task.nodes == ("gpu07", "gpu08", "gpu09", "gpu10")  # the step's list wins
    assert task.coordinator_address == f"gpu07:{PORT_BASE + 123456 % 20000}"
    # Every task of the job computes the same coordinator.
    assert slurm_task(slurm_env(SLURM_PROCID="0")).coordinator_address == task.coordinator_address
    spec = detect_cluster(RuntimeSettings.from_arguments(TrainingArguments()), env=slurm_env())
    assert (spec.source, spec.num_processes, spec.process_id) == ("slurm", 4, 2)
    assert spec.coordinator_address == task.coordinator_address


def test_slurm_variables_that_do_not_describe_a_cluster():
    assert slurm_task({}) is None
    assert slurm_task(slurm_env(SLURM_NTASKS="1")) is None
    without_rank = slurm_env()
    del without_rank["SLURM_PROCID"]  # sbatch's shell, outside srun
    assert slurm_task(without_rank) is None
    with pytest.raises(ArgumentError, match="SLURM_PROCID=4 is outside 0..3"):
        slurm_task(slurm_env(SLURM_PROCID="4"))
    with pytest.raises(ArgumentError, match="SLURM_NTASKS='four'"):
        slurm_task(slurm_env(SLURM_NTASKS="four"))


def test_sbatch_script_starts_one_jaxtrain_per_task():
    options = SbatchOptions(
        nodes=2,
        tasks_per_node=4,
        gpus_per_task=1,
        time="2:00:00",
        partition="gpu",
        setup=["source .venv/bin/activate"],
    )
    script = sbatch_script(["train", "cfg.yaml", "--learning_rate", "1e-3"], options, python="py")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --time=2:00:00",
        "#SBATCH --partition=gpu",
    ):
        assert line in lines
    assert not any("cpus-per-task" in line for line in lines)  # unset options are left out
    assert lines.index("source .venv/bin/activate") < lines.index(
        "srun --kill-on-bad-exit=1 py -m jaxtrain.cli train cfg.yaml --learning_rate 1e-3"
    )
    # bash accepts it.
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    with pytest.raises(ArgumentError, match="--nodes must be a positive integer"):
        SbatchOptions(nodes=0)


def test_sbatch_script_quotes_arguments_with_spaces():
    script = sbatch_script(
        ["train", "--sample.prompt", "def f(x):"], SbatchOptions(), python=sys.executable
    )
    assert "--sample.prompt 'def f(x):'" in script


def test_sbatch_values_with_blanks_are_refused():
    """sbatch splits an #SBATCH line at blanks: `--job_name "my job"` named the job "my"."""
    with pytest.raises(ArgumentError, match="--job_name 'my job': an #SBATCH value cannot"):
        SbatchOptions(job_name="my job")
    with pytest.raises(ArgumentError, match="--output 'logs/x %j.out'"):
        SbatchOptions(output="logs/x %j.out")


def test_cli_launch_slurm_prints_the_script_and_rejects_mixed_options(capsys):
    from jaxtrain.cli import main

    tokens = ["launch", "--slurm", "--nodes", "2", "--tasks_per_node=4", "--time", "1:00:00"]
    assert (
        main([*tokens, "--setup", "module load cuda", "train", "cfg.yaml", "--max_steps", "9"]) == 0
    )
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=4\n" in script
    assert "\nmodule load cuda\n" in script
    assert script.rstrip().endswith("-m jaxtrain.cli train cfg.yaml --max_steps 9")
    assert main(["launch", "--slurm", "--num_processes", "2", "train"]) == 2
    assert "belong to the other backend" in capsys.readouterr().err
    assert main(["launch", "train", "cfg.yaml"]) == 2
    assert "pass --ray or --slurm" in capsys.readouterr().err
    assert main(["launch", "--ray", "--nodes", "x", "train"]) == 2
    assert "--nodes 'x': expected int" in capsys.readouterr().err
    assert main(["launch", "--help"]) == 0 and "--num_processes N" in capsys.readouterr().out
    assert main(["tune", "-h"]) == 0 and "--search KEY=SPACE" in capsys.readouterr().out

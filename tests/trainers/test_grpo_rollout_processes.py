"""GRPO's rollouts in processes of their own (rollout_processes): real processes, each with
an engine, sample shares of each round; the run equals the one-process run, and a rollout
process killed mid-run is said in one line, replaced, and the run goes on unchanged."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from test_grpo import Completions, big_first_number, grpo_args, prompts
from trainer_fixtures import tiny_model

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import RunSettings
from jaxtrain.trainers import GRPOTrainer
from jaxtrain.trainers.grpo import check_rollout_processes

SETTINGS = dict(max_steps=4, num_iterations=1, beta=0.04, save_steps=None, max_staleness=1)


def train(tokenizer, out, seen, reward=big_first_number, **overrides):
    trainer = GRPOTrainer(
        arguments=grpo_args(out, **{**SETTINGS, **overrides}),
        model=tiny_model(),
        reward_funcs=[reward],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[seen],
    )
    trainer.train()
    return trainer


def same_run(a: Completions, b: Completions) -> None:
    assert sorted(a.by_step) == sorted(b.by_step) == [1, 2, 3, 4]
    for step in a.by_step:
        assert a.by_step[step] == b.by_step[step], step
        for key in ("loss", "reward", "kl", "sampling/sampling_logp_difference/max"):
            assert a.logs[step][key] == b.logs[step][key], (step, key)


@pytest.fixture(scope="module")
def one_process(tokenizer, tmp_path_factory):
    """The asynchronous run (k = 1) with the engine in the trainer's process."""
    seen = Completions()
    train(tokenizer, tmp_path_factory.mktemp("here"), seen)
    return seen


def test_two_rollout_processes_equal_the_one_process_run(tokenizer, tmp_path, one_process):
    seen = Completions()
    trainer = train(tokenizer, tmp_path, seen, rollout_processes=2)
    same_run(one_process, seen)
    workers = trainer.train_source.rollout_workers
    assert workers.workers == []  # stopped with the run
    assert all(
        seen.logs[s]["rollout/weight_send_s"] >= 0 for s in seen.logs if "reward" in seen.logs[s]
    )


def test_a_killed_rollout_process_is_said_replaced_and_the_run_unchanged(
    tokenizer, tmp_path, one_process, caplog
):
    """The reward function kills the rollout process once, after the second round's
    completions came back: the third round's request finds it dead."""
    holder: dict = {}

    def kill_once(prompts, completions, **kwargs):
        holder["calls"] = holder.get("calls", 0) + 1
        if holder["calls"] == 2:
            pid = holder["trainer"].train_source.rollout_workers.pids[0]
            holder["killed"] = pid
            os.kill(pid, signal.SIGKILL)
        return big_first_number(prompts, completions, **kwargs)

    seen = Completions()
    trainer = GRPOTrainer(
        arguments=grpo_args(tmp_path, **SETTINGS, rollout_processes=1),
        model=tiny_model(),
        reward_funcs=[kill_once],
        dataset_train=prompts(),
        processing_class=tokenizer,
        callbacks=[seen],
    )
    holder["trainer"] = trainer
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "rollout process" in r.getMessage()]
    assert said == [
        f"rollout process 0 (pid {holder['killed']}) was killed by SIGKILL while sampling; a "
        "new one samples the same prompts again from the same parameters (restart 1 of at "
        "most 3 in a row)."
    ]
    same_run(one_process, seen)


def test_rollout_processes_say_what_they_cannot_do(tmp_path):
    with pytest.raises(ArgumentError, match="rollout_processes=-1 must be an integer >= 0"):
        grpo_args(tmp_path, rollout_processes=-1)
    with pytest.raises(ArgumentError, match="sample either in processes of their own or on"):
        grpo_args(tmp_path, rollout_processes=1, rollout_devices=1)
    settings = RunSettings.from_arguments(grpo_args(tmp_path, rollout_processes=1))
    with pytest.raises(ArgumentError, match="serve a trainer in one process"):
        check_rollout_processes(settings, 2, None)
    with pytest.raises(ArgumentError, match="rollouts with tools run in the trainer's process"):
        check_rollout_processes(settings, 1, object())
    check_rollout_processes(settings, 1, None)

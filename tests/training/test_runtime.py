"""The run's environment is built once (jaxtrain.runtime) and passed down, never rebuilt."""

import dataclasses

import jax
import pytest
from tiny_run import tiny_arguments, tiny_model, token_dataset

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.parallel import ModelFactory
from jaxtrain.runtime import Runtime
from jaxtrain.trainers.distill import DistillationArguments, DistillationTrainer


def test_a_trainer_given_a_runtime_uses_its_plan_and_options(tmp_path):
    arguments = tiny_arguments(str(tmp_path), xla_compiler_options={})
    runtime = Runtime.from_arguments(arguments)
    trainer = Trainer(arguments=arguments, model=tiny_model(), runtime=runtime)
    assert trainer.runtime is runtime
    assert trainer.sharding_plan is runtime.plan and trainer.mesh is runtime.mesh
    assert trainer.monitor.compiler_options == runtime.compiler_options == {}


def test_a_trainer_without_one_builds_it_from_its_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS")  # the suite's flags set the level (tests/conftest.py)
    trainer = Trainer(arguments=tiny_arguments(str(tmp_path)), model=tiny_model())
    assert trainer.runtime.settings.xla_compiler_options is None
    assert trainer.runtime.compiler_options == {"xla_backend_optimization_level": 1}
    assert trainer.runtime.is_main_process and trainer.runtime.process_count == 1
    assert trainer.mesh.size == len(jax.devices())


def test_a_teacher_is_created_on_the_run_s_own_mesh(tmp_path):
    values = tiny_arguments(str(tmp_path), max_steps=2)
    arguments = DistillationArguments(**dataclasses.asdict(values))
    runtime = Runtime.from_arguments(arguments)
    trainer = DistillationTrainer(
        arguments=arguments,
        model=tiny_model(),
        teacher_model=ModelFactory(tiny_model),
        dataset_train=token_dataset(),
        runtime=runtime,
    )
    kernel = trainer.model.teacher.model.embed_tokens.embedding[...]
    assert kernel.sharding.mesh is runtime.mesh


def test_arguments_that_ask_for_another_environment_are_refused(tmp_path):
    runtime = Runtime.from_arguments(tiny_arguments(str(tmp_path)))
    other = tiny_arguments(
        str(tmp_path), xla_compiler_options={"xla_backend_optimization_level": 2}
    )
    with pytest.raises(ArgumentError, match=r"xla_compiler_options=.*runtime: None"):
        Trainer(arguments=other, model=tiny_model(), runtime=runtime)


def test_devices_and_a_runtime_together_are_refused(tmp_path):
    arguments = tiny_arguments(str(tmp_path))
    runtime = Runtime.from_arguments(arguments)
    with pytest.raises(ArgumentError, match="both devices= and runtime="):
        Trainer(arguments=arguments, model=tiny_model(), runtime=runtime, devices=jax.devices())


def test_a_program_given_the_flat_arguments_says_what_it_takes():
    """Program once took the arguments; code written for that gets a line, not an
    AttributeError from deep inside."""
    from jaxtrain.training.program import Program

    with pytest.raises(ArgumentError, match=r"RunSettings\.from_arguments\(args\)"):
        Program(None, None, TrainingArguments(), schedule_length=1)

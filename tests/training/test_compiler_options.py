"""TrainingArguments.xla_compiler_options reach every compile of the run; bad ones are refused
when the Trainer is built."""

import dataclasses

import pytest
from tiny_run import tiny_arguments, tiny_model, tiny_trainer

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.config.tables import CPU_DEFAULTS
from jaxtrain.parallel import ModelFactory
from jaxtrain.runtime.compiler import resolve_compiler_options
from jaxtrain.trainers.distill import DistillationArguments, DistillationTrainer


def test_none_means_the_platform_defaults_and_an_empty_dict_means_xla_s_own(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS")  # the suite's flags set the level (tests/conftest.py)
    assert resolve_compiler_options(None, "cpu") == CPU_DEFAULTS
    assert resolve_compiler_options(None, "gpu") == {}
    assert resolve_compiler_options({}, "cpu") == {}
    given = {"xla_backend_optimization_level": 3}
    assert resolve_compiler_options(given, "gpu") == given


def test_the_cpu_trainer_compiles_with_the_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS")
    trainer = tiny_trainer(str(tmp_path))
    assert trainer.monitor.compiler_options == CPU_DEFAULTS


def test_a_level_in_xla_flags_wins_over_the_cpu_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert resolve_compiler_options(None, "cpu") == {}
    assert tiny_trainer(str(tmp_path)).monitor.compiler_options == {}
    assert resolve_compiler_options({"xla_backend_optimization_level": 2}, "cpu") == {
        "xla_backend_optimization_level": 2  # options given to the run still win over both
    }


@pytest.mark.parametrize("factory", [False, True], ids=["built_model", "model_factory"])
def test_the_state_build_compiles_with_the_run_s_xla_options(tmp_path, factory):
    # The initialisation is a compile of the run like the step: XLA's default options made
    # a ModelFactory's init of the S2 bench model compile in 2.3 s, against 1.3 s.
    dump = tmp_path / "xla"
    options = {"xla_backend_optimization_level": 1, "xla_dump_to": str(dump)}
    model = ModelFactory(tiny_model) if factory else tiny_model()
    tiny_trainer(
        str(tmp_path / "run"), model=model, max_steps=2, xla_compiler_options=options
    ).train()
    debug_options = {p.name.split(".")[1]: p.read_text() for p in dump.glob("*.debug_options")}
    init = "jit_init" if factory else "jit__new_state"
    assert {init, "jit_train_step"} <= set(debug_options), sorted(debug_options)
    for name in (init, "jit_train_step"):
        assert "xla_backend_optimization_level: 1" in debug_options[name]


def test_an_option_xla_does_not_know_is_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ArgumentError, match="xla_compiler_options.*xla_no_such_option"):
        tiny_trainer(str(tmp_path), xla_compiler_options={"xla_no_such_option": 1})


def test_a_task_trainer_refuses_them_before_creating_a_model_factory_s_model(tmp_path):
    # A distillation teacher (like a DPO reference) is created before the Trainer is built:
    # the runtime, which checks the options, comes first.
    created = []

    def counted_model():
        created.append(1)
        return tiny_model()

    values = tiny_arguments(str(tmp_path), xla_compiler_options={"xla_no_such_option": 1})
    arguments = DistillationArguments(**dataclasses.asdict(values))
    with pytest.raises(ArgumentError, match="xla_compiler_options.*xla_no_such_option"):
        DistillationTrainer(
            arguments=arguments,
            model=ModelFactory(counted_model),
            teacher_model=ModelFactory(counted_model),
        )
    assert not created


def test_the_cli_form_is_a_yaml_mapping():
    args = TrainingArguments.from_dict(
        {"xla_compiler_options": "{xla_backend_optimization_level: 2}"}, source="--flags"
    )
    assert args.xla_compiler_options == {"xla_backend_optimization_level": 2}

"""TrainingArguments.xla_compiler_options reach every compile of the run; bad ones are refused
when the Trainer is built."""

import pytest
from tiny_run import tiny_trainer

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.training.compiler import CPU_DEFAULTS, resolve_compiler_options


def test_none_means_the_platform_defaults_and_an_empty_dict_means_xla_s_own():
    assert resolve_compiler_options(None, "cpu") == CPU_DEFAULTS
    assert resolve_compiler_options(None, "gpu") == {}
    assert resolve_compiler_options({}, "cpu") == {}
    given = {"xla_backend_optimization_level": 3}
    assert resolve_compiler_options(given, "gpu") == given


def test_the_cpu_trainer_compiles_with_the_defaults(tmp_path):
    trainer = tiny_trainer(str(tmp_path))
    assert trainer.monitor.compiler_options == CPU_DEFAULTS


def test_the_options_reach_the_train_step_compile(tmp_path):
    dump = tmp_path / "xla_dump"
    trainer = tiny_trainer(
        str(tmp_path / "run"),
        max_steps=2,
        xla_compiler_options={"xla_dump_to": str(dump)},
    )
    trainer.train()
    dumped = {path.name for path in dump.iterdir()}
    assert any("train_step" in name for name in dumped), sorted(dumped)[:10]


def test_an_option_xla_does_not_know_is_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ArgumentError, match="xla_compiler_options.*xla_no_such_option"):
        tiny_trainer(str(tmp_path), xla_compiler_options={"xla_no_such_option": 1})


def test_the_cli_form_is_a_yaml_mapping():
    args = TrainingArguments.from_dict(
        {"xla_compiler_options": "{xla_backend_optimization_level: 2}"}, source="--flags"
    )
    assert args.xla_compiler_options == {"xla_backend_optimization_level": 2}

"""`--help` lists a task's own fields, and launch/tune every option with type and default."""

import dataclasses
import inspect
import re
from pathlib import Path

from jaxtrain.cli import main
from jaxtrain.cli.launch_options import RAY_OPTIONS, SLURM_OPTIONS, TUNE_OPTIONS
from jaxtrain.distributed.cluster import ClusterConfig
from jaxtrain.distributed.slurm import SbatchOptions

DOCS = Path(__file__).parents[1] / "docs"


def help_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_train_help_lists_the_task_fields(capsys):
    text = help_of(capsys, "train", "--help")
    for field in ("--beta FLOAT  (default: 0.1)", "--loss_type STR", "--distill_alpha FLOAT"):
        assert field in text
    assert "One of: sigmoid, ipo, hinge." in text


def test_train_task_help_lists_that_task_s_class_and_fields(capsys):
    text = help_of(capsys, "train", "--task", "dpo", "--help")
    assert "DPOArguments (--field value" in text
    assert "--beta FLOAT  (default: 0.1)" in text and "Strength of the implicit KL" in text
    assert "--precompute_reference_logps BOOL" in text and "--distill_alpha" not in text
    sft = help_of(capsys, "train", "--task=sft", "-h")
    assert "--completion_only_loss BOOL  (default: True)" in sft
    assert main(["train", "--task", "dpoo", "--help"]) == 2
    assert "is not a task" in capsys.readouterr().err


def page(name: str) -> str:
    return (DOCS / name).read_text()


def test_launch_and_tune_help_give_type_default_and_every_documented_option(capsys):
    launch = help_of(capsys, "launch", "--help")
    tune = help_of(capsys, "tune", "--help")
    for backend in ("--ray", "--slurm"):  # help after the backend flag is the same help
        assert help_of(capsys, "launch", backend, "--help") == launch
    assert "--num_processes INT  (default: 1)" in launch
    assert "--time STR  (default: None)" in launch and "--submit" in launch
    assert "--scheduler STR  (default: 'asha')" in tune
    assert "--search STR" in tune and "--grace_period INT  (default: 1)" in tune
    named = set(re.findall(r"jaxtrain (?:launch|tune)[^\n`]*", page("clusters.md")))
    flags = {f for line in named for f in re.findall(r"--(\w+)", line)}
    documented = {*RAY_OPTIONS, *SLURM_OPTIONS, *TUNE_OPTIONS, "ray", "slurm", "submit", "search"}
    trial_flags = flags - documented  # passed on to each trial's `jaxtrain train`
    assert all(f in tune or f in launch for f in flags - trial_flags)
    for flag in documented:
        assert f"--{flag}" in launch + tune, flag


def test_option_defaults_are_the_code_s_defaults():
    for options, cls in ((RAY_OPTIONS, ClusterConfig), (SLURM_OPTIONS, SbatchOptions)):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for name, option in options.items():
            field = fields[name]
            default = (
                field.default_factory() if field.default is dataclasses.MISSING else field.default
            )
            assert option.default == default, name
    from jaxtrain.cli.tune import tune_runs

    params = inspect.signature(tune_runs).parameters
    for name, option in TUNE_OPTIONS.items():
        if name in params:
            assert option.default == params[name].default, name


def test_the_usage_names_every_task(capsys):
    """The usage's `--task` list was once a literal that missed kto, orpo and cpo: it is the
    task definitions'."""
    from jaxtrain.tasks import TASKS

    assert main([]) in (0, 2)
    usage = capsys.readouterr()
    listed = re.search(r"--task ([a-z|]+)\]", usage.out + usage.err).group(1).split("|")
    assert listed == list(TASKS)


def test_serve_help_and_usage_name_every_serve_option(capsys):
    """`serve --help` once lacked --lora, --decode_steps and --max_images, which it accepts."""
    from jaxtrain.cli.serve import OPTIONS, SERVE_USAGE

    text = help_of(capsys, "serve", "--help")
    missing = [name for name in OPTIONS if f"--{name} " not in text]
    assert not missing, missing
    assert [name for name in OPTIONS if f"--{name} " not in SERVE_USAGE + " "] == []

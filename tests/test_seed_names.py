"""EasyDeL names given to jaxtrain are answered with the jaxtrain way, from the command line,
a YAML file and Python keyword arguments alike (one table: jaxtrain/seed_names.py)."""

import re
from pathlib import Path

import pytest

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.cli import main
from jaxtrain.seed_names import SEED_ARGUMENT_NAMES
from jaxtrain.task_arguments import DPOArguments

EASYDEL_PAGE = Path(__file__).parents[1] / "docs" / "easydel.md"


@pytest.mark.parametrize(
    ("name", "value", "answer"),
    [
        ("use_wandb", "true", "`use_wandb` is `report_to: [wandb]` in jaxtrain"),
        ("evaluation_steps", "5", "`evaluation_steps` is `eval_steps` in jaxtrain"),
        ("sharding_array", "1,-1,1,1", "`sharding_array` is `sharding_axis_dims` in jaxtrain"),
        ("save_directory", "runs/x", "`save_directory` is `output_dir` in jaxtrain"),
        ("report_steps", "5", "`report_steps` is `logging_steps` in jaxtrain"),
        ("per_device_train_batch_size", "8", "is `total_batch_size` in jaxtrain"),
    ],
)
def test_cli_answers_a_seed_name_with_the_jaxtrain_way(capsys, name, value, answer):
    assert main(["train", f"--{name}", value]) == 2
    err = capsys.readouterr().err
    assert answer in err and "did you mean" not in err and "Traceback" not in err


def test_yaml_answers_a_seed_name_with_the_jaxtrain_way(tmp_path, capsys):
    config = tmp_path / "easydel.yaml"
    config.write_text("use_wandb: true\nper_device_eval_batch_size: 8\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "`use_wandb` is `report_to: [wandb]` in jaxtrain" in err
    assert "`per_device_eval_batch_size` is `eval_batch_size` in jaxtrain" in err


def test_python_keyword_arguments_answer_a_seed_name_with_an_argument_error():
    with pytest.raises(ArgumentError, match="`per_device_train_batch_size` is `total_batch_size`"):
        TrainingArguments(per_device_train_batch_size=8)
    with pytest.raises(ArgumentError, match="`use_wandb` is `report_to: \\[wandb\\]`"):
        DPOArguments(beta=0.2, use_wandb=True)
    with pytest.raises(ArgumentError, match="did you mean 'learning_rate'"):
        TrainingArguments(learnin_rate=1e-3)


def test_every_seed_name_of_the_table_is_in_the_docs_page():
    section = EASYDEL_PAGE.read_text()
    listed = set(re.findall(r"^\| `(\w+)`", section, flags=re.M))
    assert set(SEED_ARGUMENT_NAMES) <= listed, set(SEED_ARGUMENT_NAMES) - listed


def test_a_dpo_config_given_to_the_reward_task_names_which_keys_belong_to_which_task(
    tmp_path, capsys
):
    config = tmp_path / "dpo.yaml"
    config.write_text("beta: 0.2\nloss_type: ipo\nmax_steps: 3\n")
    # The docs' form: the config file after the flags.
    assert main(["train", "--task", "reward", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "--task reward" in err
    # beta and loss_type are fields of several tasks (the preference family, the RL tasks).
    assert re.search(r"beta is a field of --task [a-z /]*\bdpo\b", err), err
    assert re.search(r"loss_type is a field of --task [a-z /]*\bdpo\b", err), err
    assert "Traceback" not in err


def test_the_config_file_may_stand_anywhere_on_the_line(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("learning_rate: -1\n")
    assert main(["train", "--max_steps", "3", str(config), "--seed", "1"]) == 2
    assert "learning_rate must be > 0" in capsys.readouterr().err
    assert main(["train", "a.yaml", "--seed", "1", "b.yaml"]) == 2
    assert "one positional argument expected" in capsys.readouterr().err

import json

import pytest

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.cli.run_config import parse_overrides, resolve_config, split_config


def test_defaults_are_valid_and_derived_values():
    args = TrainingArguments(total_batch_size=16, gradient_accumulation_steps=4)
    assert args.micro_batch_size == 4
    assert args.resolved_eval_batch_size == 4
    assert args.total_steps(steps_per_epoch=10) == 10
    assert TrainingArguments(max_steps=7).total_steps(steps_per_epoch=10) == 7
    assert TrainingArguments(num_train_epochs=3).total_steps(steps_per_epoch=10) == 30


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"learning_rate": -1.0}, ["learning_rate", "> 0"]),
        ({"learning_rate": 0.0}, ["learning_rate"]),
        (
            {"total_batch_size": 10, "gradient_accumulation_steps": 4},
            ["total_batch_size=10", "gradient_accumulation_steps=4", "multiple"],
        ),
        ({"optimizer": "adamm"}, ["optimizer", "adamw", "Did you mean"]),
        ({"scheduler": "exponential"}, ["scheduler", "wsd"]),
        ({"dtype": "float8"}, ["dtype", "bfloat16"]),
        ({"gradient_checkpointing": "all"}, ["gradient_checkpointing", "nothing_saveable"]),
        ({"progress_bar": "fancy"}, ["progress_bar", "tqdm"]),
        ({"max_steps": 0}, ["max_steps"]),
        ({"scheduler": "warmup_cosine"}, ["warmup_steps"]),
        ({"save_steps": 0}, ["save_steps"]),
        # Built, then a bare ValueError from the data loader (the CLI's exit 1, a traceback).
        ({"seed": -1}, ["TrainingArguments.seed must be >= 0", "-1"]),
        ({"adam_beta2": 1.5}, ["adam_beta2"]),
        ({"eval_steps": None}, ["eval_steps", "must be an integer", "None"]),
        ({"eval_steps": 0}, ["eval_steps", "--evaluation_strategy no"]),  # how to say "never"
        ({"logging_steps": "10"}, ["logging_steps", "must be an integer"]),
        # From Python a float where an int is declared once built, then failed inside the run
        # ("total_steps must be an int > 0 ... got 5.0", "seed must be integer").
        ({"max_steps": 3.5}, ["TrainingArguments.max_steps must be an integer, got 3.5"]),
        ({"total_batch_size": 4.0}, ["total_batch_size must be an integer"]),
        ({"learning_rate": "1e-3"}, ["learning_rate must be a number, got '1e-3' (str)"]),
        ({"packing": 1}, ["packing must be true or false"]),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, words):
    with pytest.raises(ArgumentError) as info:
        TrainingArguments(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_scheduler_spelling_is_normalised():
    assert TrainingArguments(scheduler="Warmup-Cosine", warmup_steps=5).scheduler == "warmup_cosine"


def test_from_dict_coerces_strings_and_rejects_unknown_keys():
    args = TrainingArguments.from_dict(
        {"learning_rate": "1e-3", "max_steps": "20", "clip_grad": "none", "shuffle_train": "false"}
    )
    assert args.learning_rate == 1e-3 and args.max_steps == 20
    assert args.clip_grad is None and args.shuffle_train is False
    with pytest.raises(ArgumentError, match="learning_rat.*did you mean 'learning_rate'"):
        TrainingArguments.from_dict({"learning_rat": 1e-3})
    with pytest.raises(ArgumentError, match="max_steps.*int"):
        TrainingArguments.from_dict({"max_steps": "ten"})


def test_yaml_and_json_round_trip(tmp_path):
    args = TrainingArguments(learning_rate=1e-3, max_steps=5, dtype="bfloat16", clip_grad=None)
    args.save(tmp_path / "a.json")
    assert TrainingArguments.load(tmp_path / "a.json") == args
    (tmp_path / "a.yaml").write_text("learning_rate: 1e-3\nmax_steps: 5\ndtype: bfloat16\n")
    loaded = TrainingArguments.load(tmp_path / "a.yaml", max_steps=9)
    assert loaded.learning_rate == 1e-3 and loaded.max_steps == 9 and loaded.dtype == "bfloat16"
    assert json.loads((tmp_path / "a.json").read_text())["clip_grad"] is None


def test_cli_overrides_win_over_file_and_reach_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.01\nmodel:\n  hidden_size: 64\n  num_hidden_layers: 3\n")
    overrides = parse_overrides(["--learning_rate", "1e-3", "--model.hidden_size=32"])
    config = resolve_config(str(path), overrides)
    args, model, data, sample = split_config(config)
    assert args.learning_rate == 1e-3
    assert model["hidden_size"] == 32 and model["num_hidden_layers"] == 3
    # A config file starts from the defaults, not the demo (docs/command-line.md: "Which settings apply").
    assert data == {"source": "default"} and sample == {} and args.weight_decay == 0.0
    with pytest.raises(ArgumentError, match="section"):
        resolve_config(None, {"optim.lr": "1"})
    with pytest.raises(ArgumentError, match="needs a value"):
        parse_overrides(["--learning_rate"])
    with pytest.raises(ArgumentError, match="sample"):
        split_config({**config, "sample": {"promt": "x"}})


@pytest.mark.parametrize(
    ("text", "expected"), [("[]", []), ("[1, 3]", [1, 3]), ("1,3", [1, 3]), ("2", [2])]
)
def test_list_fields_parse_from_the_command_line(text, expected):
    overrides = parse_overrides(
        ["--model.model_type", "qwen3_moe", "--model.mlp_only_layers", text]
    )
    _, model, _, _ = split_config(resolve_config(None, overrides))
    assert model["mlp_only_layers"] == expected


def test_a_list_field_with_a_bad_item_names_the_item():
    overrides = parse_overrides(
        ["--model.model_type", "qwen3_moe", "--model.mlp_only_layers", "1,x"]
    )
    with pytest.raises(ArgumentError, match=r"model.mlp_only_layers\[1\] .* must be int"):
        split_config(resolve_config(None, overrides))


def test_building_arguments_imports_no_jax_and_is_fast():
    """The configuration layer checks everything without the implementation: building every
    task's arguments (each class of the task table; once three of the eight) imports no jax,
    flax or optax, and takes a small part of what importing jax takes."""
    import subprocess
    import sys

    code = """
import sys, time
start = time.perf_counter()
from jaxtrain.tasks import TASKS
from jaxtrain.arguments import TrainingArguments
TrainingArguments(optimizer="AdamW", lora_rank=4, lora_targets="attention,mlp",
                  sharding_axis_dims="1,-1,1,1,1", training_time_limit="1h",
                  pruning_targets=["mlp"], max_steps=10)
built = set()
for task in TASKS.values():  # with settings, so the checks run on them
    built.add(type(task.arguments(max_steps=5, total_batch_size=8, lora_rank=4)).__name__)
seconds = time.perf_counter() - start
heavy = sorted(m for m in ("jax", "flax", "optax", "numpy") if m in sys.modules)
print(seconds, len(built), heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, built, heavy = out.stdout.split(" ", 2)
    assert heavy.strip() == "[]", heavy
    assert int(built) == 9  # TrainingArguments and the eight task classes
    # "Fast" against importing jax in a process beside it (0.2-0.25x here), not against a
    # wall-clock figure: CI's two busy cores once took 0.301 s for what a quiet one does in 0.2.
    # Half of jax's import still catches a heavy import (transformers alone takes about as long).
    jax_code = (
        "import time; start = time.perf_counter(); import jax; print(time.perf_counter() - start)"
    )
    jax_seconds = subprocess.run(
        [sys.executable, "-c", jax_code], capture_output=True, text=True, check=True
    ).stdout
    assert float(seconds) < 0.5 * float(jax_seconds), (seconds, jax_seconds)


def test_sections_take_every_value_from_the_arguments():
    """A section has no defaults of its own: it cannot disagree with the arguments."""
    import dataclasses

    from jaxtrain.config import sections

    args = TrainingArguments(truncation_mode="keep_start", drop_last=False, packing_window=64)
    for section in (sections.DataSettings, sections.OptimizerSettings, sections.LoopSettings):
        assert all(
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            for f in dataclasses.fields(section)
        ), section
    data = sections.DataSettings.from_arguments(args)
    assert (data.truncation_mode, data.drop_last, data.packing_window) == ("keep_start", False, 64)
    default = sections.DataSettings.from_arguments(TrainingArguments())
    assert (default.truncation_mode, default.drop_last, default.packing_window) == (
        "keep_end",
        True,
        1024,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.seq_len = 3  # type: ignore[misc]


def test_a_task_section_is_named_after_its_arguments_class():
    """The name an error about a section shows (a rollout process unpickling it, say)."""
    from jaxtrain.config.sections import task_settings
    from jaxtrain.rollout_arguments import GRPOArguments, RLOOArguments
    from jaxtrain.task_arguments import DPOArguments

    names = [type(task_settings(cls(output_dir="runs/x"))).__name__
             for cls in (GRPOArguments, RLOOArguments, DPOArguments)]  # fmt: skip
    assert names == ["GRPOSettings", "RLOOSettings", "DPOSettings"]

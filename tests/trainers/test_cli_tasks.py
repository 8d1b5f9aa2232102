"""`jaxtrain train --task sft|dpo|kto|orpo|cpo|reward|distill`: each runs from a YAML file,
and bad preference data exits 2 with the row and column named. (eval, sample and export of
every task's run directory: test_run_dir_commands.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jaxtrain.cli import main

MODEL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
RUN = dict(
    max_steps=1,
    total_batch_size=4,
    max_sequence_length=16,
    warmup_steps=0,
    logging_steps=1,
    evaluation_strategy="no",
    progress_bar="none",
    run_report=False,
    save_final=False,
    report_to="jsonl",
)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_tasks")
    tokenizer.save_pretrained(root / "tokenizer")
    pairs = [
        {"prompt": f"what is {i} + 1 ?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"}
        for i in range(8)
    ]
    sft = [{"prompt": f"what is {i} + 1 ?", "completion": f"{i + 1}"} for i in range(8)]
    unpaired = [{**row, "label": i % 3 != 0} for i, row in enumerate(sft)]
    return {
        "unpaired": write_rows(root / "unpaired.jsonl", unpaired),
        "root": root,
        "pairs": write_rows(root / "pairs.jsonl", pairs),
        "sft": write_rows(root / "sft.jsonl", sft),
        "no_chosen": write_rows(
            root / "no_chosen.jsonl", [{"prompt": p["prompt"], "rejected": "1"} for p in pairs]
        ),
        "empty_rejected": write_rows(
            root / "empty.jsonl",
            [{**p, "rejected": "" if i == 1 else "1"} for i, p in enumerate(pairs)],
        ),
    }


def config(files, task: str, rows: str, eval_rows: str | None = None, **extra) -> str:
    values = {
        **RUN,
        "task": task,
        "output_dir": str(files["root"] / f"run_{task}_{rows}"),
        "model": dict(MODEL),
        "data": {
            "source": "files",
            "train_files": str(files[rows]),
            "tokenizer": str(files["root"] / "tokenizer"),
            **({"eval_files": str(files[eval_rows])} if eval_rows else {}),
        },
        **extra,
    }
    path = files["root"] / f"{task}_{rows}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.mark.parametrize(
    "task, rows, extra",
    [
        ("sft", "sft", {}),
        ("dpo", "pairs", {"beta": 0.2, "loss_type": "ipo"}),
        ("kto", "pairs", {"undesirable_weight": 1.5}),
        ("kto", "unpaired", {"loss_type": "apo_zero_unpaired"}),
        ("orpo", "pairs", {"beta": 0.2}),
        ("cpo", "pairs", {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5}),
        ("reward", "pairs", {}),
        ("distill", "sft", {"teacher": dict(MODEL), "distill_alpha": 0.7}),
    ],
)
def test_every_task_trains_from_the_command_line(files, task, rows, extra):
    assert main(["train", config(files, task, rows, **extra)]) == 0
    logs = [
        json.loads(line) for line in (files["root"] / f"run_{task}_{rows}" / "metrics.jsonl").open()
    ]
    assert any("loss" in entry for entry in logs)


def test_bad_preference_rows_exit_2_naming_row_and_column(files, capsys):
    assert main(["train", config(files, "dpo", "no_chosen")]) == 2
    assert "no column 'chosen'" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                config(files, "lm", "empty_rejected"),
                "--task",
                "dpo",
                "--shuffle_train",
                "false",
            ]
        )
        == 2
    )
    assert "row 1: column 'rejected' is empty" in capsys.readouterr().err


def test_an_unknown_task_names_the_tasks(files, capsys):
    assert main(["train", config(files, "ppo", "pairs")]) == 2
    from jaxtrain.tasks import TASKS

    assert f"use one of {', '.join(TASKS)} (lm:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def base_dir(files, tokenizer):
    """A 'pretrained' model directory whose weights no seed of the run reproduces."""
    from trainer_fixtures import tiny_model

    from jaxtrain.hf.save import save_pretrained

    return save_pretrained(
        tiny_model(seed=11, vocab_size=len(tokenizer)),
        files["root"] / "base",
        tokenizer=tokenizer,
    )


@pytest.mark.parametrize(
    "task, rows, extra",
    [("dpo", "pairs", {"beta": 0.2}), ("kto", "pairs", {}), ("sft", "sft", {"lora_rank": 4})],
    ids=["dpo_reference", "kto_reference", "lora_base"],
)
def test_eval_of_a_fine_tuned_run_rebuilds_its_frozen_parts_from_the_base(
    files, base_dir, task, rows, extra, capsys
):
    """A reference (DPO's, KTO's) and LoRA's base are not in a checkpoint: `jaxtrain eval`
    rebuilds them from the run's pretrained base, so it reports the run's own final evaluation
    (a random init of them gave another loss), and refuses when the base directory is gone
    (KTO's once evaluated against a random reference: only DPO's was known to need it)."""
    run_dir = files["root"] / f"run_{task}_from_base"
    settings = {"save_final": True, "output_dir": str(run_dir), "evaluation_strategy": "steps"}
    path = Path(config(files, task, rows, eval_rows=rows, **extra, **settings))
    values = yaml.safe_load(path.read_text())
    values["model"] = {"pretrained": str(base_dir)}
    values["data"].pop("tokenizer")  # the base's own
    path.write_text(yaml.safe_dump(values))
    assert main(["train", str(path)]) == 0
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    final_eval = [entry for entry in trained if "eval/loss" in entry][-1]
    capsys.readouterr()

    assert main(["eval", str(run_dir)]) == 0
    printed = dict(
        line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if ": " in line
    )
    assert float(printed["eval/loss"]) == pytest.approx(final_eval["eval/loss"], abs=1e-4)

    moved = base_dir.with_name(f"base_moved_{task}")
    base_dir.rename(moved)
    try:
        assert main(["eval", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert "fine-tuned from" in err and str(base_dir) in err and "base_model" in err
    finally:
        moved.rename(base_dir)


def test_a_resumed_distillation_says_its_teacher_changed(files, capsys):
    """A checkpoint holds no frozen model: a resumed run builds the teacher of its own
    config, which went unsaid."""
    path = config(files, "distill", "sft", teacher=dict(MODEL), save_final=True)
    assert main(["train", path]) == 0
    assert main(["train", path, "--max_steps", "2"]) == 0
    assert "differ from the checkpoint's run" not in capsys.readouterr().out
    other = ["--teacher.num_hidden_layers", "2", "--max_steps", "3"]
    assert main(["train", path, *other]) == 0
    out = capsys.readouterr().out
    assert (
        "jaxtrain: this run's task sections differ from the checkpoint's run "
        "(teacher.num_hidden_layers 1 -> 2): from step 3 on it trains with this run's"
    ) in out, out


def test_a_reward_run_says_its_sample_section_is_not_used(files, capsys):
    path = config(files, "reward", "pairs", sample={"max_new_tokens": 8, "temperature": 0.5})
    assert main(["train", path]) == 0
    out = capsys.readouterr().out
    assert (
        "jaxtrain: --task reward writes no text, so its sample section (max_new_tokens, "
        "temperature) is not used."
    ) in out

"""A bad row anywhere in a map-style dataset fails the task trainer's construction, before
anything compiles, with the row check's own message (data/row_checks.py). A user's KTO file
with `"label": "no"` at row 390 of 400 once failed after compiling and 35 steps, and
dropping the row, as advised, made the run's checkpoints refuse to resume. A bad row read
mid-run still says to fix it in place once the run has checkpoints (training/loop.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_fixtures import StepMetrics, tiny_arguments, tiny_model

from jaxtrain.data.errors import DatasetError
from jaxtrain.trainers import (
    DPOArguments,
    DPOTrainer,
    KTOArguments,
    KTOTrainer,
    ORPOArguments,
    ORPOTrainer,
    SFTArguments,
    SFTTrainer,
)

ROWS = 300  # the bad one is the last


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def pairs(n: int) -> list[dict]:
    return [
        {"prompt": f"what is {i % 7} + 1 ?", "chosen": f"{i % 7 + 1}", "rejected": f"{i % 5}"}
        for i in range(n)
    ]


def thumbs(n: int) -> list[dict]:
    return [
        {"prompt": f"what is {i % 7} + 1 ?", "completion": f"{i % 9}", "label": i % 2 == 0}
        for i in range(n)
    ]


def without(row: dict, column: str) -> dict:
    return {k: v for k, v in row.items() if k != column}


# (trainer, its arguments, rows, the last row made bad, what the error says of it)
CASES = {
    # (a "no" among booleans is refused as the file is read: data/arrow_rows.py)
    "kto label": (
        KTOTrainer, KTOArguments, thumbs, lambda r: {**r, "label": None},
        r"column 'label' must be True/False \(desirable or not\), got None",
    ),
    "orpo empty rejected": (
        ORPOTrainer, ORPOArguments, pairs, lambda r: {**r, "rejected": ""},
        r"column 'rejected' is empty",
    ),
    "dpo missing rejected": (
        DPOTrainer, DPOArguments, pairs, lambda r: without(r, "rejected"),
        r"column 'rejected' is missing \(null\)",
    ),
    "sft missing completion": (
        SFTTrainer, SFTArguments, thumbs, lambda r: without(r, "completion"),
        r"column 'completion' is missing \(null\)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_last_row_of_a_file_fails_before_anything_compiles(case, tokenizer, tmp_path):
    cls, args_cls, make_rows, spoil, message = CASES[case]
    rows = make_rows(ROWS)
    rows[-1] = spoil(rows[-1])
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    seen = StepMetrics()
    with pytest.raises(DatasetError, match=rf"dataset_train row {ROWS - 1}: {message}"):
        cls(  # the constructor: train() would compile first
            arguments=tiny_arguments(args_cls, tmp_path, max_steps=2),
            model=tiny_model(),
            dataset_train=train,
            processing_class=tokenizer,
            callbacks=[seen],
        )
    assert seen.steps == []


def test_the_eval_set_and_precomputed_reference_rows_are_checked_before_compiling(
    tokenizer, tmp_path
):
    rows = pairs(ROWS)
    rows[-1] = {**rows[-1], "chosen": None}
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    good = write_jsonl(tmp_path / "good.jsonl", pairs(16))
    with pytest.raises(
        DatasetError, match=rf"dataset_eval row {ROWS - 1}: column 'chosen' is missing \(null\)"
    ):
        ORPOTrainer(
            arguments=tiny_arguments(ORPOArguments, tmp_path, max_steps=2),
            model=tiny_model(),
            dataset_train=good,
            dataset_eval=bad,
            processing_class=tokenizer,
        )
    # The reference's log-probs of every row are computed (compiled) in the constructor.
    args = tiny_arguments(DPOArguments, tmp_path, max_steps=2, precompute_reference_logps=True)
    with pytest.raises(
        DatasetError, match=rf"dataset_train row {ROWS - 1}: column 'chosen' is missing \(null\)"
    ):
        DPOTrainer(
            arguments=args, model=tiny_model(), dataset_train=bad, processing_class=tokenizer
        )


# Fails on the content "boom" only: a row the up-front check cannot see (it needs the template).
PICKY_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}"
    "{% endif %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
)


def test_a_row_that_fails_mid_run_says_to_fix_it_in_place_once_there_are_checkpoints(
    tokenizer, tmp_path
):
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{i % 7}"},
                {"role": "assistant", "content": "+"},
            ]
        }
        for i in range(48)
    ]
    rows[45]["messages"][1]["content"] = "boom"  # read at step 6, after the save at step 2
    args = tiny_arguments(
        SFTArguments, tmp_path, max_steps=6, save_steps=2, shuffle_train=False, packing=False,
        chat_template=PICKY_TEMPLATE,
    )  # fmt: skip
    trainer = SFTTrainer(
        arguments=args, model=tiny_model(), dataset_train=rows, processing_class=tokenizer
    )
    with pytest.raises(DatasetError, match="row 45.*no boom") as err:
        trainer.train()
    assert "fix that row in place rather than dropping it" in str(err.value)
    assert "the latest at step" in str(err.value)

"""The task trainers' batches count what truncation cut and what padding filled, as the
language-model path's do: `data/truncated_tokens` and `data/padding_tokens` in metrics.jsonl and
the end-of-run truncation summary. DPO, KTO and SFT's prompt + completion rows are encoded to
fit `max_sequence_length` before collation; they logged 0 for both, and said nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trainer_fixtures import tiny_arguments, tiny_model

from jaxtrain.trainers import (
    DPOArguments,
    DPOTrainer,
    KTOArguments,
    KTOTrainer,
    SFTArguments,
    SFTTrainer,
)

L = 7  # a long row (6 prompt tokens + answer + eos) loses 1 token, a short one (4) pads 1


def pairs() -> list[dict[str, str]]:
    rows = []
    for i in range(8):
        prompt = f"what is {i} + 1 ?" if i % 2 else f"what is {i} ?"
        rows.append({"prompt": prompt, "chosen": str(i + 1), "rejected": str(i + 2)})
    return rows


def lengths(tokenizer, prompt: str, response: str) -> int:
    """Tokens of prompt + response + eos, as a user counts them with the tokenizer."""
    return len(tokenizer(prompt)["input_ids"]) + len(
        tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    )


def expected(tokenizer, sequences: list[tuple[str, str]]) -> tuple[float, float]:
    """(tokens cut, padding) of these prompt + response sequences at L tokens each."""
    sizes = [lengths(tokenizer, p, r) for p, r in sequences]
    return float(sum(max(n - L, 0) for n in sizes)), float(sum(max(L - n, 0) for n in sizes))


def first_logged(out_dir: Path) -> dict:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if "data/truncated_tokens" in r)


def train(trainer_cls, args_cls, tmp_path, tokenizer, rows, **overrides):
    args = tiny_arguments(
        args_cls,
        tmp_path,
        max_steps=1,
        total_batch_size=len(rows),  # every row in the one step, whatever the order
        max_sequence_length=L,
        **overrides,
    )
    trainer_cls(
        arguments=args, model=tiny_model(), dataset_train=rows, processing_class=tokenizer
    ).train()
    return first_logged(Path(args.output_dir))


def test_dpo_counts_both_sides_cuts_and_padding_and_sums_them_up(tokenizer, tmp_path, caplog):
    rows = pairs()
    sides = [(r["prompt"], r[s]) for r in rows for s in ("chosen", "rejected")]
    cut, padding = expected(tokenizer, sides)
    assert cut and padding  # the rows exercise both
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        logged = train(DPOTrainer, DPOArguments, tmp_path, tokenizer, rows)
    assert (logged["data/truncated_tokens"], logged["data/padding_tokens"]) == (cut, padding)
    read = len(sides) * L - padding + cut
    end = [r.getMessage() for r in caplog.records if "at the end of the run" in r.getMessage()]
    assert len(end) == 1 and f"({int(cut)} of {int(read)})" in end[0], end


def test_kto_counts_its_sequences_and_pads_its_kl_sequences_too(tokenizer, tmp_path):
    rows = [
        {"prompt": r["prompt"], "completion": r["chosen"], "label": i % 3 != 0}
        for i, r in enumerate(pairs())
    ]
    cut, padding = expected(tokenizer, [(r["prompt"], r["completion"]) for r in rows])
    # Each KL sequence is a prompt with another row's completion: all completions are one
    # token here, so the KL side pads as the matched side does (its cut is not the data's).
    logged = train(KTOTrainer, KTOArguments, tmp_path, tokenizer, rows)
    assert (logged["data/truncated_tokens"], logged["data/padding_tokens"]) == (cut, 2 * padding)


def test_sft_prompt_completion_rows_count_their_cut(tokenizer, tmp_path):
    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in pairs()]
    cut, padding = expected(tokenizer, [(r["prompt"], r["completion"]) for r in rows])
    logged = train(SFTTrainer, SFTArguments, tmp_path, tokenizer, rows, packing=False)
    assert (logged["data/truncated_tokens"], logged["data/padding_tokens"]) == (cut, padding)


def test_packed_pairs_count_the_cuts_of_the_pairs_they_hold(tokenizer, tmp_path):
    # Long rows only: each side of a pair loses one token, and a row of L holds one side,
    # so the step's rows hold half as many pairs as it has rows: one token cut per row.
    rows = [r for r in pairs() if "+" in r["prompt"]]
    logged = train(DPOTrainer, DPOArguments, tmp_path, tokenizer, rows, packing=True)
    assert logged["data/truncated_tokens"] == float(len(rows))
    assert logged["data/padding_tokens"] == 0.0

"""The Trainer with packed, streamed data: exact resume through a checkpoint, data log fields."""

from __future__ import annotations

import logging

import datasets
import numpy as np
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.checkpointing import read_metadata
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.observability.logs import read_jsonl


class LossRecorder:
    def __init__(self, stop_at=None):
        self.losses, self.stop_at = {}, stop_at

    def on_step_end(self, trainer, state, metrics, step):
        self.losses[step] = float(metrics["loss_sum"]) / float(metrics["tokens"])
        if step == self.stop_at:
            trainer.should_stop = True


def stream(n: int = 60) -> datasets.IterableDataset:
    rng = np.random.default_rng(0)
    rows = [
        {"input_ids": rng.integers(1, 63, size=int(k)).tolist()}
        for k in rng.integers(3, 12, size=n)
    ]
    return datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=3)


def trainer(out: str, recorder: LossRecorder) -> Trainer:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    args = TrainingArguments(
        output_dir=out,
        max_steps=8,
        total_batch_size=4,
        max_sequence_length=16,
        packing=True,
        stream_window=16,
        logging_steps=2,
        progress_bar="none",
        learning_rate=1e-2,
        seed=1,
        evaluation_strategy="no",
    )
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    return Trainer(arguments=args, model=model, dataset_train=stream(), callbacks=[recorder])


def test_packed_stream_resumes_exactly_through_a_checkpoint(tmp_path):
    straight = LossRecorder()
    trainer(str(tmp_path / "a"), straight).train()
    first = LossRecorder(stop_at=3)
    out = trainer(str(tmp_path / "b"), first).train()
    state = read_metadata(out.checkpoint_path)["data_state"]
    assert state["kind"] == "stream" and state["packing"] and state["step"] == 3
    second = LossRecorder()
    trainer(str(tmp_path / "b"), second).train()
    assert sorted(second.losses) == list(range(4, 9))
    np.testing.assert_allclose(
        [{**first.losses, **second.losses}[s] for s in range(1, 9)],
        [straight.losses[s] for s in range(1, 9)],
        rtol=0,
        atol=0,
    )
    logs = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert {"data_wait_s", "data/padding_tokens", "data/truncated_tokens"} <= set(logs[0])


def rows_trainer(out, rows, **overrides) -> Trainer:
    """A one-layer Llama on `rows` of token ids, two rows of 8 tokens a step."""
    args = TrainingArguments(
        output_dir=str(out), total_batch_size=2, max_sequence_length=8, progress_bar="none",
        evaluation_strategy="no", save_final=False, **overrides,
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    return Trainer(arguments=args, model=model, dataset_train=rows)


def test_truncation_is_warned_at_start_and_in_the_run_summary(tmp_path, caplog):
    long_rows = datasets.Dataset.from_dict({"input_ids": [[3] * 20] * 4})
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        rows_trainer(tmp_path, long_rows, max_steps=3).train()
    messages = [r.getMessage() for r in caplog.records]
    assert any("60.0% of its tokens (48 of 80, in 4 of 4 rows)" in m for m in messages)
    # 3 steps x 2 rows of 20 tokens read, 8 kept of each.
    end = [m for m in messages if "at the end of the run" in m]
    assert len(end) == 1 and "dropped 60.0% of the tokens read (72 of 120)" in end[0], messages


def test_rows_with_nothing_to_learn_are_warned_and_counted(tmp_path, caplog):
    """Empty (or one-token) rows trained as all padding without a word. Two steps of two
    rows: each row once."""
    rows = datasets.Dataset.from_dict({"input_ids": [[3] * 8, [4], [5] * 6, [6]]})
    with caplog.at_level(logging.WARNING, logger="jaxtrain"):
        rows_trainer(tmp_path, rows, max_steps=2).train()
    messages = [r.getMessage() for r in caplog.records]
    first = [m for m in messages if "rows of a training batch have no token to learn" in m]
    assert len(first) == 1 and "empty text" in first[0], messages
    end = [m for m in messages if "at the end of the run" in m]
    assert end == [
        "jaxtrain: at the end of the run, 2 of the 4 rows trained on had no token to learn "
        "from (empty text, a one-token row, or completion_only_loss with the completion "
        "truncated away; they train as padding. Drop such rows, or raise "
        "max_sequence_length)."
    ], messages


def test_each_logged_window_counts_its_own_batches_padding(tmp_path):
    """The counts were read when the window was written, one batch later: the first window
    had two batches' padding, the last none."""
    rows = datasets.Dataset.from_dict({"input_ids": [[3] * 5] * 8})  # 3 padding tokens each
    rows_trainer(tmp_path, rows, max_steps=3, logging_steps=1).train()
    logs = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["data/padding_tokens"] for r in logs] == [6.0, 6.0, 6.0]

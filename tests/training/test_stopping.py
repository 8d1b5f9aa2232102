"""Stopping early without losing work: durations, time limits, signals, NaN/Inf losses."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_run import VOCAB, tiny_arguments, tiny_model, tiny_trainer, token_dataset

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.checkpointing import committed_steps, read_metadata
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.training.stopping import NonFiniteLossError, StopSignals, parse_duration

POISON = VOCAB - 1  # a token id that token_dataset never draws


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2h30m", 9000),
        ("1d", 86400),
        ("90m", 5400),
        ("45s", 45),
        ("1.5h", 5400),
        ("1h 5m 3s", 3903),
        ("01:30:00", 5400),
        ("1-12:00:00", 129600),
        ("10:30", 630),
    ],
)
def test_durations_parse(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["90", "2x", "h", "1h30", "-5m", "0s", ""])
def test_ambiguous_or_bad_durations_are_refused(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_bad_time_limit_and_on_nan_are_argument_errors(tmp_path):
    with pytest.raises(ArgumentError, match="training_time_limit"):
        TrainingArguments(output_dir=str(tmp_path), training_time_limit="90")
    with pytest.raises(ArgumentError, match="on_nan"):
        TrainingArguments(output_dir=str(tmp_path), on_nan="ignore")
    inside = str(tmp_path / "checkpoints" / "3")  # what overwriting would delete
    with pytest.raises(ArgumentError, match="resume_from=.* is inside output_dir"):
        TrainingArguments(output_dir=str(tmp_path), resume_from=inside, overwrite_output_dir=True)


def test_first_signal_requests_a_stop_and_a_second_aborts():
    previous = signal.getsignal(signal.SIGINT)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is previous  # handlers restored


def test_time_limit_saves_and_stops_at_the_current_step(tmp_path):
    trainer = tiny_trainer(str(tmp_path / "run"), max_steps=10_000, training_time_limit="1s")
    output = trainer.train()
    step = int(output.state.step)
    assert output.stop_reason == "time_limit"
    assert 0 < step < 10_000
    assert committed_steps(tmp_path / "run" / "checkpoints") == [step]
    assert read_metadata(output.checkpoint_path)["step"] == step


def test_save_interval_minutes_saves_without_save_steps(tmp_path):
    saves = []

    class Saves:
        def on_save(self, trainer, path, step):
            saves.append(step)

    trainer = tiny_trainer(str(tmp_path / "run"), max_steps=6, save_interval_minutes=1e-6)
    trainer.callbacks.append(Saves())
    trainer.train()
    assert saves == [1, 2, 3, 4, 5, 6]


class PoisonedTrainer(Trainer):
    """The loss is NaN for any micro-batch that contains the POISON token."""

    def compute_loss_sums(self, model, batch, rng):
        sums = super().compute_loss_sums(model, batch, rng)
        poisoned = jnp.any(batch["input_ids"] == POISON)
        sums["loss_sum"] = jnp.where(poisoned, jnp.nan, sums["loss_sum"])
        return sums


def poisoned_dataset(poisoned_rows):
    dataset = token_dataset()

    def poison(row, index):
        if index in poisoned_rows:
            row["input_ids"] = [POISON] + row["input_ids"][1:]
        return row

    return dataset.map(poison, with_indices=True)


def test_nan_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    # No shuffling, 8 rows per step: row 40 is in the batch of step 6 (1-based).
    trainer = PoisonedTrainer(
        arguments=tiny_arguments(str(tmp_path / "run"), shuffle_train=False, save_steps=2),
        model=tiny_model(),
        dataset_train=poisoned_dataset({40}),
    )
    with pytest.raises(NonFiniteLossError, match="step 6"):
        trainer.train()
    assert committed_steps(tmp_path / "run" / "checkpoints") == [2, 4]
    restored = trainer.load_checkpoint(tmp_path / "run")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored))


def test_nan_skip_drops_only_the_bad_updates(tmp_path):
    seen = {}

    class Snapshot:
        def on_step_end(self, trainer, state, metrics, step):
            seen[step] = jax.tree.map(np.asarray, nnx.to_pure_dict(state.params))

    trainer = PoisonedTrainer(
        arguments=tiny_arguments(
            str(tmp_path / "run"), shuffle_train=False, on_nan="skip", max_steps=6
        ),
        model=tiny_model(),
        dataset_train=poisoned_dataset({0, 20}),  # steps 1 and 3
        callbacks=[Snapshot()],
    )
    initial = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.create_state().params))
    output = trainer.train()
    same = jax.tree.map(np.array_equal, initial, seen[1])
    assert all(jax.tree.leaves(same)), "step 1's bad update must not be applied"
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, seen[2], seen[3])))
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, seen[3], seen[4])))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(output.state))
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert records[-1]["nonfinite_skipped_steps"] == 2
    assert all(np.isfinite(r["loss"]) for r in records)  # skipped steps do not poison averages


def test_nan_skip_gives_up_after_max_consecutive_skips(tmp_path):
    trainer = PoisonedTrainer(
        arguments=tiny_arguments(
            str(tmp_path / "run"), shuffle_train=False, on_nan="skip", max_nan_skips=1
        ),
        model=tiny_model(),
        dataset_train=poisoned_dataset({8, 16}),  # steps 2 and 3, consecutive
    )
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps up to step 3"):
        trainer.train()


def test_a_window_of_skipped_steps_logs_no_loss_of_zero_and_counts_its_own_skip(tmp_path):
    """A window whose every update was skipped logged loss 0.0 and perplexity 1.0 (its sums
    are zeroed: 0/0), a perfect loss where the run diverged; and the skip count lagged a step
    (the guard reads each flag one step late)."""
    trainer = PoisonedTrainer(
        arguments=tiny_arguments(
            str(tmp_path / "run"),
            shuffle_train=False,
            on_nan="skip",
            max_steps=4,
            logging_steps=1,
        ),  # fmt: skip
        model=tiny_model(),
        dataset_train=poisoned_dataset({8}),  # step 2
    )
    trainer.train()
    records = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in r}
    # JSON has no NaN: the log writes non-finite values as strings.
    assert (records[2]["loss"], records[2]["perplexity"]) == ("nan", "nan"), records[2]
    assert records[2]["nonfinite_skipped_steps"] == 1
    assert "nonfinite_skipped_steps" not in records[1]
    assert records[3]["loss"] > 0 and records[4]["nonfinite_skipped_steps"] == 1

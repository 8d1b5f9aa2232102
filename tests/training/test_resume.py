"""Resuming is exact, and a resume that cannot happen is an error, never a fresh start."""

import shutil

import jax
import numpy as np
import pytest
from tiny_run import tiny_arguments, tiny_model, tiny_trainer, token_dataset

from jaxtrain.checkpointing import CheckpointError, committed_steps, read_metadata
from jaxtrain.data import DatasetError
from jaxtrain.errors import ArgumentError
from jaxtrain.observability.logs import read_jsonl


class LossRecorder:
    """Per-step losses (reading device values each step is fine in a test)."""

    def __init__(self, stop_at=None):
        self.losses, self.stop_at = {}, stop_at

    def on_step_end(self, trainer, state, metrics, step):
        self.losses[step] = float(metrics["loss_sum"]) / float(metrics["tokens"])
        if step == self.stop_at:
            trainer.should_stop = True


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    # Shuffled data over several epochs (12 steps x 8 rows of 96) and 2 micro-batches per
    # step, so the data position, the schedule and the optimizer state are all exercised.
    straight = LossRecorder()
    reference = tiny_trainer(str(tmp_path / "straight"), max_steps=24)
    reference.callbacks.append(straight)
    expected = reference.train()

    first_half = LossRecorder(stop_at=12)
    interrupted = tiny_trainer(str(tmp_path / "resumed"), max_steps=24)
    interrupted.callbacks.append(first_half)
    stopped = interrupted.train()
    assert stopped.stop_reason == "callback" and int(stopped.state.step) == 12

    second_half = LossRecorder()
    resumed_trainer = tiny_trainer(str(tmp_path / "resumed"), max_steps=24)
    resumed_trainer.callbacks.append(second_half)
    resumed = resumed_trainer.train()

    assert sorted(second_half.losses) == list(range(13, 25))
    assert {**first_half.losses, **second_half.losses} == straight.losses
    for a, b in zip(leaves(expected.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    # The metric log reads as one run: each logged step once, in order.
    steps = [r["step"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(2, 25, 2))
    assert read_metadata(resumed.checkpoint_path)["data_state"]["step"] == 24


def test_bfloat16_moments_are_saved_as_such_and_resume_bit_exactly(tmp_path):
    """mu_dtype="bfloat16": the checkpoint holds AdamW's first moment in bfloat16 and a run
    stopped and resumed ends bit-equal to an uninterrupted one."""
    expected = tiny_trainer(str(tmp_path / "straight"), max_steps=6, mu_dtype="bfloat16").train()
    interrupted = tiny_trainer(str(tmp_path / "resumed"), max_steps=6, mu_dtype="bfloat16")
    interrupted.callbacks.append(LossRecorder(stop_at=3))
    interrupted.train()
    restarted = tiny_trainer(str(tmp_path / "resumed"), max_steps=6, mu_dtype="bfloat16")
    restored = restarted.load_checkpoint(tmp_path / "resumed" / "checkpoints" / "3")
    dtypes = [x.dtype for x in jax.tree.leaves(restored.opt_state) if x.ndim]
    assert dtypes.count(np.dtype("bfloat16")) == dtypes.count(np.dtype("float32")) > 0
    resumed = restarted.train()
    for a, b in zip(leaves(expected.state), leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_trims_log_records_past_the_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    tiny_trainer(str(run), max_steps=4).train()
    log = run / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 6, "loss": 1.0}\n{"step": 8, "lo')  # a kill -9
    capsys.readouterr()
    tiny_trainer(str(run), max_steps=6).train()
    steps = [r["step"] for r in read_jsonl(log) if "loss" in r]
    assert steps == [2, 4, 6]
    # The longer run stretches the cosine schedule, and says so (it once did in silence).
    printed = capsys.readouterr()
    assert "schedule follows this run's arguments (max_steps 4 -> 6)" in printed.out + printed.err
    # So does a setting that shapes the updates (a task's beta or alpha too): resumed in silence.
    decay = tiny_arguments(str(run)).weight_decay
    tiny_trainer(str(run), max_steps=8, weight_decay=decay + 0.5).train()
    printed = capsys.readouterr()
    said = f"settings differ from the checkpoint's (weight_decay {decay!r} -> {decay + 0.5!r})"
    assert said in printed.out + printed.err


def test_a_task_s_own_settings_are_compared_on_resume():
    from jaxtrain.checkpointing.compat import setting_changes
    from jaxtrain.trainers import DPOArguments
    from jaxtrain.training.trainer_checkpoints import task_fields

    args = DPOArguments(output_dir="unused", beta=0.1)
    fields = task_fields(args)
    assert "beta" in fields and "learning_rate" not in fields
    saved, now = args.to_dict(), {**args.to_dict(), "beta": 0.5}
    assert setting_changes(saved, now, fields) == "beta 0.1 -> 0.5"
    assert setting_changes(saved, saved, fields) is None


def test_a_different_model_is_refused_with_what_differs(tmp_path):
    tiny_trainer(str(tmp_path / "run"), max_steps=2).train()
    with pytest.raises(CheckpointError, match=r"hidden_size: checkpoint 32, now 48") as err:
        tiny_trainer(str(tmp_path / "run"), model=tiny_model(hidden_size=48)).train()
    assert "--resume_if_possible false" in str(err.value)


def test_damaged_checkpoint_files_are_an_error_not_a_fresh_start(tmp_path):
    tiny_trainer(str(tmp_path / "run"), max_steps=2).train()
    state_dir = tmp_path / "run" / "checkpoints" / "2" / "state"
    for path in state_dir.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"checkpoints/2/state"):
        tiny_trainer(str(tmp_path / "run"), max_steps=4).train()


def test_another_optimizer_needs_reset_optimizer(tmp_path):
    first = tiny_trainer(str(tmp_path / "run"), max_steps=2).train()
    with pytest.raises(CheckpointError, match="reset_optimizer"):
        tiny_trainer(str(tmp_path / "run"), max_steps=4, optimizer="lion").train()

    steps = LossRecorder()
    trainer = tiny_trainer(
        str(tmp_path / "run"), max_steps=3, optimizer="lion", reset_optimizer=True
    )
    trainer.callbacks.append(steps)
    start_params = {}
    trainer.callbacks.append(
        type(
            "P", (), {"on_train_start": lambda s, t, st: start_params.update(p=leaves(st.params))}
        )()
    )
    output = trainer.train()
    assert list(steps.losses) == [3]  # continued at step 2, not from scratch
    for a, b in zip(leaves(first.state.params), start_params["p"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(output.state.step) == 3


def test_changed_data_is_refused(tmp_path):
    tiny_trainer(str(tmp_path / "run"), max_steps=2).train()
    with pytest.raises(DatasetError, match="num_rows: saved 96, now 80"):
        tiny_trainer(str(tmp_path / "run"), max_steps=4, dataset=token_dataset(rows=80)).train()


def test_resume_from_an_explicit_checkpoint(tmp_path):
    tiny_trainer(str(tmp_path / "a"), max_steps=4, save_steps=2).train()
    steps = LossRecorder()
    trainer = tiny_trainer(
        str(tmp_path / "b"), max_steps=4, resume_from=str(tmp_path / "a" / "checkpoints" / "2")
    )
    trainer.callbacks.append(steps)
    trainer.train()
    assert list(steps.losses) == [3, 4]
    assert committed_steps(tmp_path / "b" / "checkpoints") == [4]
    with pytest.raises(CheckpointError, match="No committed checkpoint"):
        tiny_trainer(str(tmp_path / "c"), resume_from=str(tmp_path / "missing")).train()
    # b holds checkpoints of its own: refused, unless overwrite_output_dir deletes them
    # (the checkpoint resumed is a's, which it leaves alone; it was refused too).
    again = dict(max_steps=4, resume_from=str(tmp_path / "a" / "checkpoints" / "2"))
    with pytest.raises(CheckpointError, match="holds checkpoints of its own"):
        tiny_trainer(str(tmp_path / "b"), **again).train()
    steps = LossRecorder()
    trainer = tiny_trainer(str(tmp_path / "b"), **again, overwrite_output_dir=True, save_steps=3)
    trainer.callbacks.append(steps)
    trainer.train()
    assert list(steps.losses) == [3, 4]
    assert committed_steps(tmp_path / "b" / "checkpoints") == [3, 4]
    assert committed_steps(tmp_path / "a" / "checkpoints") == [2, 4]


def test_keep_limit_never_deletes_the_newest_checkpoints(tmp_path):
    tiny_trainer(str(tmp_path / "run"), max_steps=7, save_steps=2, save_total_limit=2).train()
    assert committed_steps(tmp_path / "run" / "checkpoints") == [6, 7]


def test_uncommitted_leftovers_are_ignored_and_cleared(tmp_path):
    run = tmp_path / "run"
    tiny_trainer(str(run), max_steps=2).train()
    # What a save killed half-way leaves behind: a tmp directory with partial files.
    partial = run / "checkpoints" / "4.orbax-checkpoint-tmp-1234"
    shutil.copytree(run / "checkpoints" / "2", partial)
    steps = LossRecorder()
    trainer = tiny_trainer(str(run), max_steps=4)
    trainer.callbacks.append(steps)
    trainer.train()
    assert list(steps.losses) == [3, 4]  # resumed from 2, the newest committed
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "4"]


def test_saves_run_in_the_background_while_training_continues(tmp_path):
    # ~4M parameters (+ Adam moments, ~50 MB) in a model whose step takes milliseconds:
    # the loop must take further steps before the save's directory is committed.
    events = []

    class Watch:
        def on_save(self, trainer, path, step):
            events.append(("save_started", step))

        def on_step_end(self, trainer, state, metrics, step):
            committed = committed_steps(tmp_path / "run" / "checkpoints")
            events.append(("step", step, tuple(committed)))

    trainer = tiny_trainer(
        str(tmp_path / "run"),
        model=tiny_model(hidden_size=256, vocab_size=16384),
        max_steps=12,
        save_steps=4,
        total_batch_size=2,
        gradient_accumulation_steps=1,
    )
    trainer.callbacks.append(Watch())
    trainer.train()
    after_save = [e for e in events if e[0] == "step" and e[1] > 4]
    overlapped = [e for e in after_save if 4 not in e[2]]
    assert ("save_started", 4) in events
    assert overlapped, "no step ran while the step-4 checkpoint was being written"
    assert committed_steps(tmp_path / "run" / "checkpoints") == [4, 8, 12]


def test_arguments_changed_after_the_trainer_was_built_are_named_not_ignored(tmp_path):
    trainer = tiny_trainer(str(tmp_path / "run"), max_steps=2)
    trainer.arguments.max_steps = 5  # the run is built from the arguments it was given
    with pytest.raises(ArgumentError, match=r"max_steps=2 -> 5.*Build a new Trainer"):
        trainer.train()
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing ran


def test_a_second_train_call_goes_on_after_a_hook_stopped_the_first(tmp_path):
    """`should_stop` once stayed set: the second `train()` resumed at the stop and stopped
    again at once, returning the same step."""
    stopper = LossRecorder(stop_at=2)
    trainer = tiny_trainer(str(tmp_path / "run"), max_steps=4)
    trainer.callbacks.append(stopper)
    assert int(trainer.train().state.step) == 2
    stopper.stop_at = None
    assert int(trainer.train().state.step) == 4


def test_a_checkpoint_past_max_steps_is_refused_not_called_completed(tmp_path):
    """Resuming a step-4 checkpoint into a 2-step run once returned "completed" at step 4,
    with no metrics, and a schedule note about a step 5 that never ran."""
    tiny_trainer(str(tmp_path / "run"), max_steps=4).train()
    resumed = tiny_trainer(
        str(tmp_path / "short"),
        max_steps=2,
        resume_from=str(tmp_path / "run" / "checkpoints" / "4"),
    )
    with pytest.raises(ArgumentError, match=r"is at step 4, past this run's 2 steps"):
        resumed.train()

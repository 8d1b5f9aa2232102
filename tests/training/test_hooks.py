"""Hooks with a cadence (`add_hook(hook, every=N)`), and the loop's own eval/save cadences."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_run import tiny_arguments, tiny_model, token_dataset

from jaxtrain import Trainer, TrainerCallback
from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.errors import ArgumentError
from jaxtrain.state import TrainState
from jaxtrain.training.hooks import Cadence, HookSet, ScheduledHook


class Recorder(TrainerCallback):
    def __init__(self, every=None):
        if every is not None:
            self.every = every
        self.events = []

    def on_step_start(self, trainer, state, step):
        self.events.append(("start", step))

    def on_step_end(self, trainer, state, metrics, step):
        self.events.append(("end", step))

    def on_evaluate_start(self, trainer, state, step):
        self.events.append(("evaluate_start", step))

    def on_evaluate(self, trainer, metrics, step):
        self.events.append(("evaluate", step))

    def on_save(self, trainer, checkpoint_path, step):
        self.events.append(("save", step))

    def of(self, kind):
        return [step for name, step in self.events if name == kind]


def test_cadence_gates_only_the_per_step_hooks():
    every_two, always = Recorder(every=2), Recorder()
    hooks = HookSet([every_two, always])
    for step in range(1, 5):
        hooks.call("on_step_end", None, None, {}, step)
        hooks.call("on_evaluate", None, {}, step)
    assert every_two.of("end") == [2, 4] and always.of("end") == [1, 2, 3, 4]
    assert every_two.of("evaluate") == [1, 2, 3, 4]  # events have cadences of their own


def test_bad_cadences_and_hooks_are_refused():
    for every in (0, -1, 1.5, True):
        with pytest.raises(ArgumentError, match="positive number of steps"):
            Cadence(every)
    with pytest.raises(ArgumentError, match="add_hook"):
        ScheduledHook(42)
    assert Cadence(3).due(6) and not Cadence(3).due(7) and not Cadence(None).due(6)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hooks") / "run"
    trainer = Trainer(
        arguments=tiny_arguments(str(out), max_steps=6, eval_steps=4, save_steps=3),
        model=tiny_model(),
        dataset_train=token_dataset(),
        dataset_eval=token_dataset(rows=8, seed=1),
    )
    plain, every_three = Recorder(), Recorder()
    function_steps = []
    trainer.callbacks.append(plain)
    trainer.add_hook(every_three, every=3)
    trainer.add_hook(lambda trainer, state, metrics, step: function_steps.append(step), every=2)
    trainer.train()
    return plain, every_three, function_steps


def test_hooks_with_a_cadence_run_when_due(run):
    plain, every_three, function_steps = run
    assert plain.of("start") == [0, 1, 2, 3, 4, 5] and plain.of("end") == [1, 2, 3, 4, 5, 6]
    assert every_three.of("start") == [0, 3] and every_three.of("end") == [3, 6]
    assert function_steps == [2, 4, 6]


def test_eval_and_save_follow_their_cadences(run):
    plain, every_three, _ = run
    # eval every 4 steps plus the last step; save every 3 steps (6 is also the last).
    assert plain.of("evaluate") == [4, 6] and plain.of("save") == [3, 6]
    # on_evaluate_start comes right before each evaluation, with its step.
    assert plain.of("evaluate_start") == [4, 6]
    assert [e for e in plain.events if e[0].startswith("evaluate")] == [
        ("evaluate_start", 4),
        ("evaluate", 4),
        ("evaluate_start", 6),
        ("evaluate", 6),
    ]
    assert every_three.of("save") == [3, 6]  # cadence does not gate event hooks


# ------------------------------------------------- hooks that hand back a state, batch, metrics
class Rewriter(TrainerCallback):
    """Zeroes the parameters before step 3 (on_step_start), sets them all to 2 after step 4
    (on_step_end), doubles every logged loss, and drops the labels of every other batch."""

    def __init__(self):
        self.max_abs = {}  # step -> largest |parameter| on_step_end saw
        self.logs = {}

    @staticmethod
    def filled(state, value):
        return state.replace(params=jax.tree.map(lambda p: p * 0.0 + value, state.params))

    def on_step_start(self, trainer, state, step):
        return self.filled(state, 0.0) if step == 2 else None  # before the 3rd step

    def on_batch(self, trainer, batch, step):
        if step % 2:
            return None
        return {**batch, "labels": batch["labels"] * 0 + IGNORE_INDEX}, {"relabelled_step": step}

    def on_step_end(self, trainer, state, metrics, step):
        largest = max(float(jnp.abs(p).max()) for p in jax.tree.leaves(state.params))
        self.max_abs[step] = largest
        metrics = {**metrics, "loss_sum": metrics["loss_sum"] * 2}
        return (self.filled(state, 2.0) if step == 4 else state), metrics

    def on_log(self, trainer, logs, step):
        self.logs[step] = logs


def rewritten_run(tmp_path, callback):
    trainer = Trainer(
        arguments=tiny_arguments(str(tmp_path), max_steps=6, logging_steps=1),
        model=tiny_model(),
        dataset_train=token_dataset(),
        callbacks=[callback],
    )
    return trainer.train()


def test_hooks_replace_the_state_the_batch_and_the_metrics(tmp_path):
    plain, rewriter = Rewriter(), Rewriter()
    plain.on_step_start = lambda *args: None  # same batches, nothing else changed
    plain.on_step_end = lambda trainer, state, metrics, step: None
    plain_logs = {}
    plain.on_log = lambda trainer, logs, step: plain_logs.__setitem__(step, logs)
    rewritten_run(tmp_path / "plain", plain)
    rewritten_run(tmp_path / "rewritten", rewriter)
    seen, logs = rewriter.max_abs, rewriter.logs
    # Step 3 stepped from zeroed parameters: one AdamW update (lr 1e-2) away from zero.
    assert seen[2] > 0.5 and seen[3] < 0.05 and seen[4] < 0.05
    # The state returned after step 4 (all 2.0) is the one step 5 ran from.
    assert 1.95 < seen[5] < 2.05
    # The batches of steps 0, 2 and 4 (logged as steps 1, 3, 5) had no labels left: no
    # target tokens, loss 0; the extra logs arrive with them.
    for step in (1, 3, 5):
        assert logs[step]["loss"] == 0.0 and logs[step]["relabelled_step"] == step - 1
    assert "relabelled_step" not in logs[2]
    # The returned metrics are the ones logged: step 2 is the same step in both runs.
    assert logs[2]["loss"] == pytest.approx(2 * plain_logs[2]["loss"], rel=1e-6)


def test_a_returned_state_must_match_the_compiled_step():
    state = TrainState.create({"w": jnp.ones((2, 3))}, optax.sgd(0.1))

    class Bad(TrainerCallback):
        def __init__(self, change):
            self.change = change

        def on_step_start(self, trainer, state, step):
            return self.change(state)

    changes = {
        "bfloat16": lambda s: s.replace(params={"w": s.params["w"].astype(jnp.bfloat16)}),
        "ndarray": lambda s: s.replace(params={"w": np.ones((2, 3), np.float32)}),
        "structure": lambda s: s.replace(params={"w": s.params["w"], "b": s.params["w"]}),
        "weak": lambda s: s.replace(step=jnp.asarray(0)),
    }
    for expected, change in changes.items():
        with pytest.raises(ArgumentError, match=rf"Bad\.on_step_start.*{expected}"):
            HookSet([Bad(change)]).step_start(None, state, 0)
    same = HookSet([Bad(lambda s: s.replace(params={"w": s.params["w"] * 2}))])
    assert float(same.step_start(None, state, 0).params["w"][0, 0]) == 2.0


def test_malformed_hook_results_are_refused():
    class Odd(TrainerCallback):
        def on_batch(self, trainer, batch, step):
            return batch, {"loss": 1.0}

        def on_step_end(self, trainer, state, metrics, step):
            return state, {}

    hooks = HookSet([Odd()])
    with pytest.raises(ArgumentError, match=r"Odd\.on_batch.*extra logs named loss"):
        hooks.batch(None, {}, 0)
    with pytest.raises(ArgumentError, match=r"Odd\.on_step_end.*without loss_sum"):
        hooks.step_end(None, {}, {"loss_sum": 1.0}, 1)
    function = HookSet([ScheduledHook(lambda trainer, state, metrics, step: 42)])
    with pytest.raises(ArgumentError, match=r"return None or \(state, metrics\)"):
        function.step_end(None, {}, {}, 1)


def test_the_batch_hook_follows_its_cadence():
    class Batches(TrainerCallback):
        every = 2

        def __init__(self):
            self.steps = []

        def on_batch(self, trainer, batch, step):
            self.steps.append(step)

    hook = Batches()
    hooks = HookSet([hook])
    for step in range(5):
        assert hooks.batch(None, {"x": step}, step) == ({"x": step}, {})
    assert hook.steps == [0, 2, 4]


def test_a_batch_of_another_shape_recompiles_with_one_warning(tmp_path, caplog, capsys):
    """The recompile's warning was printed twice: by the progress and by the logger."""

    class HalfRows(TrainerCallback):
        def on_batch(self, trainer, batch, step):
            if step == 2:  # the third batch, its rows cut to half their length
                return {k: v[..., : v.shape[-1] // 2] for k, v in batch.items()}

    trainer = Trainer(
        arguments=tiny_arguments(str(tmp_path), max_steps=3),
        model=tiny_model(),
        dataset_train=token_dataset(),
        callbacks=[HalfRows()],
    )
    with caplog.at_level("DEBUG", logger="jaxtrain.compile"):
        trainer.train()
    shown = capsys.readouterr()
    assert (shown.out + shown.err).count("recompiled train_step") == 1
    logged = [r for r in caplog.records if "recompiled train_step" in r.getMessage()]
    assert [r.levelname for r in logged] == ["DEBUG"]  # kept for whoever logs debug

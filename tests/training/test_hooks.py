"""Hooks with a cadence (`add_hook(hook, every=N)`), and the loop's own eval/save cadences."""

import pytest
from tiny_run import tiny_arguments, tiny_model, token_dataset

from jaxtrain import Trainer, TrainerCallback
from jaxtrain.errors import ArgumentError
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
    assert every_three.of("save") == [3, 6]  # cadence does not gate event hooks

"""The core's shape (issue 35), measured: a small Trainer, a loop that reads few of its members,
no layer below training/ taking a Trainer, and the arguments read in few files."""

from __future__ import annotations

import ast
import collections
import dataclasses
import inspect
import sys
from pathlib import Path

import numpy as np
from test_imports import MODULES, import_graph, layer_of

import jaxtrain
from jaxtrain.arguments import TrainingArguments
from jaxtrain.training.trainer import Trainer

ROOT = Path(jaxtrain.__file__).parent


def test_the_trainer_has_at_most_25_methods():
    methods = [
        name
        for klass in Trainer.__mro__
        if klass is not object
        for name, value in vars(klass).items()
        if (inspect.isfunction(value) or isinstance(value, property)) and name != "__init__"
    ]
    assert len(methods) <= 25, methods


def test_the_loop_reads_at_most_10_members_of_the_trainer():
    tree = ast.parse((ROOT / "training" / "loop.py").read_text())
    members = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and ast.unparse(node.value) in ("trainer", "self.trainer")
    }
    assert len(members) <= 10, sorted(members)


def test_no_function_below_training_takes_a_trainer():
    training = layer_of("jaxtrain.training")
    offences = []
    for name, path in MODULES.items():
        if layer_of(name) >= training:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                params = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                params += [a.arg for a in node.args.kwonlyargs]
                if "trainer" in params:
                    offences.append(f"{path}:{node.lineno} {node.name}")
    assert not offences, offences
    # And no such module imports the Trainer (not even for a type).
    graph = import_graph()
    assert not [n for n, t in graph.items() if layer_of(n) < training and "jaxtrain.training" in t]


def test_the_arguments_are_read_in_at_most_12_files(tmp_path, monkeypatch):
    """Every read of a TrainingArguments field during a whole run (construction, training,
    evaluation, saves, export, dry run), by the file that reads it."""
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    fields |= {"micro_batch_size", "resolved_eval_batch_size", "to_dict", "save"}
    readers: collections.Counter = collections.Counter()
    original = TrainingArguments.__getattribute__

    def spy(self, name):
        if name in fields:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(str(ROOT)):
                readers[str(Path(caller).relative_to(ROOT))] += 1
        return original(self, name)

    monkeypatch.setattr(TrainingArguments, "__getattribute__", spy)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        total_batch_size=2,
        max_sequence_length=16,
        progress_bar="none",
        run_report=False,
        save_steps=1,
        logging_steps=1,
        eval_steps=1,
    )
    rows = [{"input_ids": np.arange(16) % 50} for _ in range(8)]
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    trainer = Trainer(
        arguments=args,
        model=LlamaForCausalLM(config, rngs=nnx.Rngs(0)),
        dataset_train=rows,
        dataset_eval=rows[:2],
    )
    output = trainer.train()
    trainer.save_pretrained(output.state, tmp_path / "export")
    trainer.dry_run()
    assert "config/sections.py" in readers  # the spy sees the reads
    # The core reads its sections; the arguments are read whole only as the run's record
    # (arguments.json) and to refuse a change made to them after the Trainer was built.
    core = {f for f in readers if f.startswith(("training/", "observability/", "checkpointing/"))}
    assert core <= {"training/trainer_checkpoints.py", "training/trainer.py"}, core
    assert len(readers) <= 12, sorted(readers)


# Every file that reads a field of the flat arguments (TrainingArguments or a task's
# arguments class) through a name ending in `args` / `arguments` (bare, `self.arguments`,
# `grpo_args`, ...), as an attribute or through getattr, read from the code with `ast`.
# Issue 46's target, 12, is met: the configuration (4: the class, its checks, the sections
# built from it), the command line (5: what the user typed), and the three that write new
# arguments from a run's (the planner's alternatives and fits, a Ray job's next attempt).
# Everything else takes its section (config/sections.py: RunSettings, RuntimeSettings, a
# task's own section). A file may leave this list; none may join it.
FLAT_ARGUMENT_READERS = {
    "arguments.py", "config/checks.py", "config/parallel_checks.py", "config/sections.py",
    "cli/commands.py", "cli/plan.py", "cli/pretrained.py", "cli/run_config.py", "cli/tune.py",
    "planning/choices.py", "planning/fit.py", "distributed/job.py",
}  # fmt: skip


def names_the_arguments(node: ast.AST) -> bool:
    """`args`, `self.arguments`, `grpo_args`...: a name the flat arguments travel under."""
    name = getattr(node, "id", None) or getattr(node, "attr", None) or ""
    return name.endswith(("args", "arguments"))


def flat_argument_readers() -> dict[str, set[str]]:
    """file -> the argument fields it reads as `<args|arguments>.field`, from the code."""
    from jaxtrain import rollout_arguments, task_arguments

    classes = [TrainingArguments] + [  # the RL tasks' fields too (session 29 missed them)
        c for module in (task_arguments, rollout_arguments) for c in vars(module).values()
        if isinstance(c, type) and dataclasses.is_dataclass(c)
    ]  # fmt: skip
    fields = {f.name for c in classes for f in dataclasses.fields(c)}
    readers: dict[str, set[str]] = collections.defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in fields:  # args.beta
                base, field = node.value, node.attr
            elif (  # getattr(args, "beta", ...)
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in fields
            ):
                base, field = node.args[0], node.args[1].value
            else:
                continue
            if names_the_arguments(base):
                readers[str(path.relative_to(ROOT))].add(field)
    return readers


def test_no_new_file_reads_the_flat_arguments():
    readers = flat_argument_readers()
    assert "config/sections.py" in readers and "cli/commands.py" in readers  # the scan sees them
    assert set(readers) <= FLAT_ARGUMENT_READERS, sorted(set(readers) - FLAT_ARGUMENT_READERS)
    assert len(readers) <= 12


def task_trainer_classes() -> list[type]:
    import importlib
    import pkgutil

    import jaxtrain.trainers

    for module in pkgutil.iter_modules(jaxtrain.trainers.__path__):
        importlib.import_module(f"jaxtrain.trainers.{module.name}")
    found, todo = [], list(Trainer.__subclasses__())
    while todo:
        klass = todo.pop()
        found.append(klass)
        todo += klass.__subclasses__()
    return [k for k in found if k.__module__.startswith("jaxtrain.")]


def is_super_init(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "__init__"
        and ast.unparse(node.func.value) == "super()"
    )


def half_built_uses(klass: type) -> list[str]:
    """What `klass.__init__` does with `self` before the base Trainer is built, or after."""
    import textwrap

    init = ast.parse(textwrap.dedent(inspect.getsource(klass.__init__))).body[0]
    *before, last = init.body
    problems = [] if any(map(is_super_init, ast.walk(last))) else ["ends without super()"]
    for node in (n for statement in before for n in ast.walk(statement)):
        if is_super_init(node):
            problems.append(f"line {node.lineno}: super().__init__ is not the last statement")
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "self":
            static = inspect.getattr_static(klass, node.attr, None)
            if isinstance(node.ctx, ast.Store) or inspect.isfunction(static):
                problems.append(f"line {node.lineno}: self.{node.attr}")  # a half-built trainer
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) != "type"  # its class, for a message
            and any(
                ast.unparse(v) == "self" for v in (*node.args, *(k.value for k in node.keywords))
            )
        ):  # lent whole, as `pad_source=self` once was
            problems.append(f"line {node.lineno}: self lent to {ast.unparse(node.func)}")
    return problems


def test_a_task_trainer_is_built_in_one_phase():
    """Issue 46, design target 3: a task trainer resolves its run (TaskStart: sections,
    runtime), builds its models, objective and sources, then builds the base Trainer, last.
    Nothing is set on or called of the half-built trainer (a DPO trainer once set its
    processing_class early for a featurizer method; GRPO its reward functions)."""
    classes = task_trainer_classes()
    names = {k.__name__ for k in classes}
    assert {"DPOTrainer", "GRPOTrainer", "KTOTrainer", "RLOOTrainer", "PairTrainer"} <= names
    offences = {
        k.__qualname__: problems
        for k in classes
        if "__init__" in vars(k) and (problems := half_built_uses(k))
    }
    assert not offences, offences


def test_no_task_helper_rewrites_the_callers_keyword_arguments():
    """The keyword arguments a task trainer was given are read, never written: a helper once
    popped `devices` and put a runtime in their place (task_runtime), another added the
    collator and the packed source; TaskStart.trainer_kwargs builds the base's instead."""
    writes = ("pop", "setdefault", "update", "clear", "popitem", "__setitem__")
    offences = []
    for path in sorted((ROOT / "trainers").glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            # A dict handed in, or a trainer's own **kwargs (save_pretrained's are its own).
            given = [a.arg for a in (*function.args.args, *function.args.kwonlyargs)]
            if function.args.kwarg and function.name == "__init__":
                given.append(function.args.kwarg.arg)
            if "kwargs" not in given:
                continue
            for node in ast.walk(function):
                stored = isinstance(node, ast.Subscript) and isinstance(
                    node.ctx, ast.Store | ast.Del
                )
                called = isinstance(node, ast.Attribute) and node.attr in writes
                if (stored or called) and ast.unparse(node.value) == "kwargs":
                    offences.append(f"{path.name}:{node.lineno} {function.name}")
    assert not offences, offences


def test_only_the_arguments_module_writes_into_the_arguments():
    """Issue 46, design target 2: the arguments are read into sections, never written back
    (`jaxtrain eval` once set its batch limit on them). arguments.py's own step cap, applied
    when they are built, is the one writer."""
    writes = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del)
            set_by_call = (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("setattr", "object.__setattr__")
                and node.args
            )
            target = node.value if stored else node.args[0] if set_by_call else None
            if target is not None and names_the_arguments(target):
                writes.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert writes and all(w.startswith("arguments.py:") for w in writes), writes


def test_a_program_takes_the_run_s_sections_never_the_arguments():
    """Issue 46, design target 2: `Program(parts, runtime, settings)` is handed the sections
    (RunSettings) at every call in the package, and refuses the flat arguments."""
    import pytest

    from jaxtrain.errors import ArgumentError
    from jaxtrain.training.program import Program

    calls = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "Program" and node.args:
                given = node.args[2:3] + [k.value for k in node.keywords if k.arg == "settings"]
                calls.append((f"{path.relative_to(ROOT)}:{node.lineno}", given))
    assert len(calls) >= 3, calls  # the Trainer's, the planner's, a restored run's
    for where, given in calls:
        assert len(given) == 1 and not names_the_arguments(given[0]), where
    with pytest.raises(ArgumentError, match="Program takes the run's sections, not a Training"):
        Program(None, None, TrainingArguments(), schedule_length=1)

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
from test_imports import GRAPH, MODULES, layer_of

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
    assert not [n for n, t in GRAPH.items() if layer_of(n) < training and "jaxtrain.training" in t]


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
    assert "config/sections.py" in readers and "training/trainer.py" in readers
    assert len(readers) <= 12, sorted(readers)

"""The Trainer end to end at a tiny size, on the embedded corpus."""

import dataclasses
import json

import datasets
import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import Trainer, TrainerCallback, TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.checkpointing import CheckpointError, read_metadata
from jaxtrain.data import DatasetError, chunk_dataset, load_default_corpus
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.observability.logs import read_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def corpus():
    corpus = load_default_corpus(vocab_size=512, max_train_bytes=300_000)
    train = chunk_dataset(corpus.train, corpus.tokenizer, SEQ)
    evaluation = chunk_dataset(corpus.eval, corpus.tokenizer, SEQ).select(range(64))
    return train, evaluation, corpus.tokenizer


def tiny_model(tokenizer, **overrides):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **overrides,
    )
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def tiny_args(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run"),
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=40,
        total_batch_size=8,
        gradient_accumulation_steps=2,
        max_sequence_length=SEQ,
        logging_steps=10,
        eval_steps=20,
        eval_batch_size=16,
        progress_bar="none",
    )
    values.update(overrides)
    return TrainingArguments(**values)


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_start(self, trainer, state):
        self.events.append(("train_start", int(state.step)))

    def on_step_end(self, trainer, state, metrics, step):
        self.events.append(("step_end", step))

    def on_log(self, trainer, logs, step):
        self.events.append(("log", step))

    def on_evaluate(self, trainer, metrics, step):
        self.events.append(("evaluate", step))

    def on_save(self, trainer, path, step):
        self.events.append(("save", step))

    def on_train_end(self, trainer, output):
        self.events.append(("train_end", int(output.state.step)))


def test_train_eval_checkpoint_end_to_end(corpus, tmp_path):
    train, evaluation, tokenizer = corpus
    args = tiny_args(tmp_path, save_steps=20)
    recorder = Recorder()
    trainer = Trainer(
        arguments=args,
        model=tiny_model(tokenizer),
        dataset_train=train,
        dataset_eval=evaluation,
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    initial = trainer.evaluate(trainer.create_state())
    output = trainer.train()

    # Learning happened: eval loss fell clearly from the initial model's.
    assert output.metrics["eval/loss"] < initial["eval/loss"] - 0.5
    assert int(output.state.step) == 40
    assert output.metrics["eval/tokens"] == 64 * (SEQ - 1)

    # Hooks fired at their cadences, in order.
    kinds = [e for e in recorder.events if e[0] != "step_end"]
    assert kinds[0] == ("train_start", 0) and kinds[-1] == ("train_end", 40)
    assert [s for k, s in kinds if k == "log"] == [10, 20, 30, 40]
    assert [s for k, s in kinds if k == "evaluate"] == [20, 40]
    assert [s for k, s in kinds if k == "save"] == [20, 40]
    assert sum(1 for e in recorder.events if e[0] == "step_end") == 40

    # The metric log holds train and eval records with falling train loss.
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [10, 20, 30, 40]
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    assert all(r["tokens_per_second"] > 0 for r in train_records)
    assert any("eval/loss" in r for r in records)
    assert json.loads((tmp_path / "run" / "arguments.json").read_text())["max_steps"] == 40

    # The final checkpoint loads back to identical parameters, with its metadata.
    assert output.checkpoint_path.endswith("/40")
    restored = trainer.load_checkpoint(output.checkpoint_path)
    for a, b in zip(jax.tree.leaves(output.state), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    meta = read_metadata(output.checkpoint_path)
    assert meta["step"] == 40 and meta["model_config"]["hidden_size"] == 64
    # The user's model object now carries the trained weights.
    trained = nnx.state(trainer.model, nnx.Param)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(output.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Rerunning into the same output_dir continues the run (nothing is left to do at 40)...
    again = Trainer(arguments=args, model=tiny_model(tokenizer), dataset_train=train).train()
    assert int(again.state.step) == 40 and again.checkpoint_path == output.checkpoint_path
    # ...and with resuming switched off it refuses to mix with the old run.
    no_resume = dataclasses.replace(args, resume_if_possible=False)
    with pytest.raises(CheckpointError, match="overwrite_output_dir"):
        Trainer(arguments=no_resume, model=tiny_model(tokenizer), dataset_train=train).train()


def test_mixed_precision_keeps_float32_master_params(corpus, tmp_path):
    train, evaluation, tokenizer = corpus
    args = tiny_args(tmp_path, dtype="bfloat16", param_dtype="float32", max_steps=20, eval_steps=20)
    trainer = Trainer(
        arguments=args, model=tiny_model(tokenizer), dataset_train=train, dataset_eval=evaluation
    )
    output = trainer.train()
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(output.state.params)}
    assert dtypes == {np.dtype("float32")}
    moments = [x for x in jax.tree.leaves(output.state.opt_state) if x.ndim > 0]
    assert {x.dtype for x in moments} == {np.dtype("float32")}
    assert np.isfinite(output.metrics["eval/loss"]) and output.metrics["loss"] < 6.0
    logits = trainer.model(np.zeros((1, 4), np.int32))
    assert logits.dtype == np.dtype("bfloat16")


def test_text_column_is_tokenized_with_processing_class(corpus, tmp_path):
    _, _, tokenizer = corpus
    texts = [f"def function_{i}(x):\n    return x * {i}\n" * 3 for i in range(40)]
    ds = datasets.Dataset.from_dict({"text": texts})
    args = tiny_args(tmp_path, max_steps=6, logging_steps=3, evaluation_strategy="no")
    output = Trainer(
        arguments=args, model=tiny_model(tokenizer), dataset_train=ds, processing_class=tokenizer
    ).train()
    assert int(output.state.step) == 6 and np.isfinite(output.metrics["loss"])


@pytest.mark.parametrize(
    ("dataset", "words"),
    [
        (datasets.Dataset.from_dict({"input_ids": []}), ["dataset_train", "empty"]),
        (datasets.Dataset.from_dict({"content": ["a b"] * 20}), ["dataset_train", "content"]),
        ([{"input_ids": [1, 2, 3]}] * 3, ["dataset_train", "total_batch_size"]),
    ],
)
def test_bad_datasets_fail_before_compilation(corpus, tmp_path, dataset, words):
    _, _, tokenizer = corpus
    with pytest.raises(DatasetError) as info:
        Trainer(arguments=tiny_args(tmp_path), model=tiny_model(tokenizer), dataset_train=dataset)
    for word in words:
        assert word in str(info.value)


def test_remat_needs_model_support(tmp_path):
    class Plain(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones((2, 2), np.float32))

    with pytest.raises(ArgumentError, match="remat_policy"):
        Trainer(
            arguments=tiny_args(tmp_path, gradient_checkpointing="dots_saveable"), model=Plain()
        )


class StopAtSeven(TrainerCallback):
    def on_step_end(self, trainer, state, metrics, step):
        if step == 7:
            trainer.should_stop = True


class StopBeforeEight(TrainerCallback):
    """Stops from on_step_start: step 8 must not run (it once did)."""

    def on_step_start(self, trainer, state, step):
        if step == 7:
            trainer.should_stop = True


@pytest.mark.parametrize("stopper", [StopAtSeven, StopBeforeEight])
def test_a_hook_can_stop_training_and_the_stop_step_is_evaluated_and_saved(
    corpus, tmp_path, stopper
):
    train, evaluation, tokenizer = corpus

    recorder = Recorder()
    trainer = Trainer(
        arguments=tiny_args(tmp_path, max_steps=40, eval_steps=5, logging_steps=5),
        model=tiny_model(tokenizer),
        dataset_train=train,
        dataset_eval=evaluation,
        callbacks=[stopper(), recorder],
    )
    output = trainer.train()
    assert int(output.state.step) == 7 and output.checkpoint_path.endswith("/7")
    assert [s for k, s in recorder.events if k == "evaluate"] == [5, 7]
    assert [s for k, s in recorder.events if k == "log"] == [5, 7]


class Probe(TrainerCallback):
    """Records, at train start, whether the state holds the model's own buffers."""

    def __init__(self, model, fail_at=None):
        params = nnx.state(model, nnx.Param)
        self.pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)]
        self.fail_at, self.seen = fail_at, {}

    def on_train_start(self, trainer, state):
        leaves = jax.tree.leaves(state.params)
        # XLA may pair a donated buffer with any output of its shape: compare as sets.
        self.seen["aliased"] = sorted(x.unsafe_buffer_pointer() for x in leaves) == sorted(
            self.pointers
        )

    def on_step_end(self, trainer, state, metrics, step):
        self.seen["last"] = jax.tree.map(np.asarray, state.params)
        if step == self.fail_at:
            raise RuntimeError("a hook failed")


def test_train_uses_the_models_arrays_without_a_copy_and_gives_them_back(corpus, tmp_path):
    train, _, tokenizer = corpus
    model = tiny_model(tokenizer)
    # Copies: a zero-copy numpy view would pin the buffers and stop XLA aliasing them.
    before = jax.tree.map(lambda x: np.array(x, copy=True), nnx.state(model, nnx.Param))
    args = tiny_args(tmp_path, max_steps=3, gradient_accumulation_steps=1, warmup_steps=1)
    args = dataclasses.replace(args, evaluation_strategy="no", save_final=False)
    probe = Probe(model)
    trainer = Trainer(arguments=args, model=model, dataset_train=train, callbacks=[probe])
    initial = trainer.create_state()  # a copy: it outlives train(), whose steps donate
    output = trainer.train()
    assert probe.seen["aliased"]  # the fresh state was built around the model's own buffers
    for got, want in zip(jax.tree.leaves(initial.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    # The model object holds the trained parameters afterwards.
    after = nnx.state(model, nnx.Param)
    for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(output.state.params), strict=True):
        assert got is want
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )


def test_a_failed_run_gives_the_model_its_newest_parameters(corpus, tmp_path):
    train, _, tokenizer = corpus
    model = tiny_model(tokenizer)
    args = tiny_args(tmp_path, max_steps=5, gradient_accumulation_steps=1, warmup_steps=1)
    args = dataclasses.replace(args, evaluation_strategy="no", save_final=False)
    probe = Probe(model, fail_at=2)
    trainer = Trainer(arguments=args, model=model, dataset_train=train, callbacks=[probe])
    with pytest.raises(RuntimeError, match="a hook failed"):
        trainer.train()
    params = nnx.state(model, nnx.Param)
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(probe.seen["last"]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    model(np.zeros((1, 4), np.int32))  # usable

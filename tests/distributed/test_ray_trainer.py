"""RayDistributedTrainer without a cluster: config, scaling, processor, and the load order.

The load-order cases run the very job each Ray process runs (TrainJob.run), here in this one
process; tests/distributed/test_ray_cluster.py runs it on real Ray actors.
"""

from __future__ import annotations

import json
import warnings

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxtrain import TrainingArguments
from jaxtrain.arguments import ArgumentError
from jaxtrain.distributed import RayDistributedConfig, RayDistributedTrainer
from jaxtrain.distributed.worker import LocalContext

VOCAB, SEQ = 96, 16
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
SCALING = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}


def recipe(**kwargs) -> RayDistributedTrainer:
    kwargs.setdefault("config_scaling_variables", SCALING)
    kwargs.setdefault("config_variables", {"num_hidden_layers": 1, "seed": 7})
    return RayDistributedTrainer(BASE, **kwargs)


def test_scaling_index_multiplies_sizes_and_fixes_the_rest():
    rt = recipe(config_variables={"num_hidden_layers": 2, "rope_theta": 500.0, "dtype": "bfloat16"})
    config = rt.create_config(3)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads) == (48, 96, 6)
    assert (config.num_hidden_layers, config.rope_theta) == (2, 500.0)
    assert config.head_dim == 8  # follows the scaled hidden size and heads
    assert (config.vocab_size, config.num_key_value_heads) == (VOCAB, 1)  # from the base
    model = rt.create_model_from_config(3)
    assert model.config == config and model.dtype == np.dtype("bfloat16")
    assert model.model.embed_tokens.embedding.shape == (VOCAB, 48)
    with pytest.raises(ArgumentError, match="scaling_index must be a positive int"):
        rt.create_config(0)
    with pytest.raises(
        ArgumentError, match=r"config_variables has unknown key\(s\) \['hiden_size'\]"
    ):
        recipe(config_variables={"hiden_size": 3})
    with pytest.raises(ArgumentError, match="scaling_index=1 gives an invalid model config"):
        recipe(config_scaling_variables={"num_attention_heads": 3}).create_config(1)


def test_config_round_trips_through_readable_json(tmp_path):
    rt = recipe(
        bucket_path=str(tmp_path / "bucket"),
        config_variables={
            "dtype": jax.numpy.bfloat16,
            "param_dtype": "float32",
            "sharding_axis_dims": (1, -1, 1, 2, 1),
            "sharding_rules": {"mlp": ["tp", "sp"]},
            "seed": 3,
        },
    )
    path = rt.save_config(tmp_path / "ray.json")
    written = json.loads(path.read_text())
    assert written["config_variables"]["dtype"] == "bfloat16"
    assert written["config_variables"]["sharding_axis_dims"] == [1, -1, 1, 2, 1]
    loaded = RayDistributedTrainer.from_config(path)
    assert loaded.config == rt.config
    assert loaded.config.config_variables["dtype"] == np.dtype("bfloat16")
    assert loaded.config.config_variables["sharding_axis_dims"] == (1, -1, 1, 2, 1)
    assert loaded.create_config(2) == rt.create_config(2)
    bad = tmp_path / "bad.json"
    # (model_task is a key now, seed 003: EasyDeL's offload_backend is not one of ours)
    bad.write_text(json.dumps({**written, "offload_backend": "cpu"}))
    with pytest.raises(
        ArgumentError, match=r"unknown RayDistributedConfig key\(s\) \['offload_backend'\]"
    ):
        RayDistributedConfig.load(bad)
    bad.write_text(json.dumps({**written, "model_task": "x"}))
    with pytest.raises(ArgumentError, match=r"model_task='x' is not a task.*causal-lm"):
        RayDistributedConfig.load(bad)


# ------------------------------------------------------------------ processor
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An HF model directory: config.json and a tokenizer with no pad token."""
    from tokenizers import ByteLevelBPETokenizer

    directory = tmp_path_factory.mktemp("base")
    transformers.LlamaConfig(**BASE).save_pretrained(directory)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["hello world, the quick brown fox"] * 10,
        vocab_size=VOCAB - 4,
        special_tokens=["<s>", "</s>"],
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    )
    tokenizer.save_pretrained(directory)
    return directory


def test_processor_pads_with_eos_and_warns(model_dir):
    rt = RayDistributedTrainer(str(model_dir), config_scaling_variables={"hidden_size": 16})
    with pytest.warns(UserWarning, match="no pad token; padding with its eos token '</s>'"):
        tokenizer = rt.load_processor()
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert rt.create_config(1).vocab_size == VOCAB  # the base comes from config.json
    with pytest.raises(ArgumentError, match="pass processor_name_or_path"):
        recipe().load_processor()


def test_samples_and_messages_become_padded_ids_through_the_pipeline(model_dir):
    rt = RayDistributedTrainer(str(model_dir), config_scaling_variables={"hidden_size": 16})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tokenizer = rt.processor
    ids = tokenizer("hello world")["input_ids"]
    left = rt.process_sample_data("hello world", max_length=12)
    assert left["input_ids"].shape == (12,)
    assert left["input_ids"].tolist() == [tokenizer.pad_token_id] * (12 - len(ids)) + ids
    assert left["attention_mask"].tolist() == [0] * (12 - len(ids)) + [1] * len(ids)
    right = rt.process_sample_data(["hello world", "fox"], max_length=12, padding_side="right")
    assert right["input_ids"].shape == (2, 12) and right["input_ids"][0, : len(ids)].tolist() == ids
    assert (right["labels"][0, len(ids) :] == -100).all()
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    chat = rt.process_messages_data(messages, max_length=40)
    rendered = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False
    )["input_ids"]
    assert (
        chat["input_ids"].shape == (40,)
        and chat["input_ids"][-len(rendered) :].tolist() == rendered
    )
    assert rt.process_messages_data([messages, messages], max_length=40)["input_ids"].shape == (
        2,
        40,
    )
    with pytest.raises(ArgumentError, match="padding_side='middle'"):
        rt.process_sample_data("x", max_length=4, padding_side="middle")


# ----------------------------------------------------------------- load order
def dataset():
    rng = np.random.default_rng(0)
    return [{"input_ids": rng.integers(1, VOCAB, size=SEQ).tolist()} for _ in range(32)]


def arguments(output_dir, **overrides) -> TrainingArguments:
    # lr 1e-30: every update is far below float32 resolution, so a run ends with exactly the
    # parameters it started from, which tells where it started.
    values = dict(
        output_dir=str(output_dir),
        optimizer="sgd",
        learning_rate=1e-30,
        scheduler="constant",
        max_steps=1,
        total_batch_size=8,
        max_sequence_length=SEQ,
        logging_steps=1,
        evaluation_strategy="no",
        progress_bar="none",
        run_report=False,
        clip_grad=None,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def assert_same(a, b) -> None:
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def run(rt, args, **kwargs):
    """(job, output, context) of a one-process run of the job Ray processes run."""
    job = rt.build_job(2, args, dataset(), **kwargs)
    context = LocalContext()
    return job, job.run(context), context


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """A run with nothing given: a new model at scaling_index 2, trained one step."""
    out = tmp_path_factory.mktemp("bucket")
    rt = recipe()
    job, output, _ = run(rt, arguments(out, learning_rate=0.5))
    return dict(path=out, job=job, output=output, new=rt.create_model_from_config(2))


def test_nothing_given_starts_a_new_model_at_the_scaling_index(bucket):
    assert bucket["job"].source.kind == "new"
    assert "scaling_index=2" in bucket["job"].source.description
    start = nnx.state(bucket["new"], nnx.Param)
    assert [x.shape for x in leaves(start)] == [
        x.shape for x in leaves(bucket["output"].state.params)
    ]
    # Its config's seed made the run's initial parameters: lr=1e-30 kept them.
    job, output, _ = run(recipe(), arguments(bucket["path"].parent / "fresh"))
    for x, y in zip(leaves(output.state.params), leaves(start), strict=True):
        # The run initialises inside one jit, create_model eagerly: float rounding apart.
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-8)


def test_bucket_checkpoint_comes_before_a_new_model(bucket, tmp_path):
    rt = recipe(bucket_path=str(bucket["path"]))
    job, output, context = run(rt, arguments(tmp_path / "run", max_steps=2))
    assert job.source.kind == "checkpoint" and job.source.checkpoint.endswith("checkpoints/1")
    assert context.events[0][:2] == ("start", 1)  # resumed at the checkpoint's step
    assert_same(output.state.params, bucket["output"].state.params)


def test_given_model_comes_before_the_bucket(bucket, tmp_path):
    rt = recipe(bucket_path=str(bucket["path"]))
    model = rt.create_model(rt.create_config(2), seed=11)
    job, output, context = run(rt, arguments(tmp_path / "run"), model=model)
    assert job.source.kind == "model" and context.events[0][:2] == ("start", 0)
    assert_same(output.state.params, nnx.state(model, nnx.Param))


def test_given_state_comes_before_a_given_model(bucket, tmp_path):
    rt = recipe(bucket_path=str(bucket["path"]))
    model = rt.create_model(rt.create_config(2), seed=11)
    state = bucket["output"].state  # step 1, trained weights
    job, output, context = run(
        rt, arguments(tmp_path / "run", max_steps=2), model=model, state=state
    )
    assert job.source.kind == "state" and context.events[0][:2] == ("start", 1)
    assert_same(output.state.params, state.params)
    assert int(output.state.step) == 2


def test_importing_jaxtrain_and_the_distributed_package_does_not_import_ray():
    import subprocess
    import sys

    code = "import sys, jaxtrain, jaxtrain.distributed; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

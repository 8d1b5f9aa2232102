"""What a new user trips over on a first run (issue 16 list, issue 17 items 1-3): each bad
value is one clear error naming the fields, raised before anything is written."""

import io
import logging
import os
import subprocess
import sys

import datasets
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.cli import main
from jaxtrain.data.batch_source import LoaderSource
from jaxtrain.errors import ArgumentError, MeshError
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.observability.progress import make_progress

VOCAB = 64


def tiny_model(**overrides):
    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=None,
        eos_token_id=None,
        bos_token_id=None,
    )
    values.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**values), rngs=nnx.Rngs(0))


def ragged_rows(n: int = 16) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, VOCAB, size=int(rng.integers(4, 12))).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def args(tmp_path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "run"),
        total_batch_size=4,
        max_sequence_length=16,
        max_steps=4,
        progress_bar="none",
        run_report=False,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def word_tokenizer(**special: str) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special)


# ------------------------------------------------------------ 1 / issue 17.3: warmup
def test_warmup_longer_than_the_run_names_both_fields():
    with pytest.raises(ArgumentError, match=r"warmup_steps=30 .* 4 steps \(max_steps\)"):
        TrainingArguments(max_steps=4, warmup_steps=30)
    with pytest.raises(ArgumentError, match="wsd_decay_fraction"):
        TrainingArguments(max_steps=10, warmup_steps=6, scheduler="wsd", wsd_decay_fraction=0.5)
    TrainingArguments(max_steps=4, warmup_steps=30, scheduler="constant")  # nothing decays


def test_warmup_longer_than_an_epoch_run_fails_in_the_constructor(tmp_path):
    # 16 rows / 4 per batch = 4 steps; known only once the Trainer sees the dataset.
    arguments = args(tmp_path, max_steps=-1, warmup_steps=10)
    with pytest.raises(ArgumentError, match=r"warmup_steps=10 .*num_train_epochs"):
        Trainer(arguments=arguments, model=tiny_model(), dataset_train=ragged_rows())
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------ 2: prefetch_batches
def test_prefetch_batches_zero_is_refused_at_construction():
    with pytest.raises(ArgumentError, match="prefetch_batches must be >= 1"):
        TrainingArguments(prefetch_batches=0)


@pytest.mark.parametrize("ahead", [1, 3])
def test_prefetch_batches_is_how_far_the_trainer_reads_ahead(tmp_path, ahead):
    """While the loop holds one batch, the reader has `prefetch_batches` more placed on the
    mesh and one in hand waiting for room: it has pulled 2 + prefetch_batches host batches."""
    import threading
    import time

    trainer = Trainer(arguments=args(tmp_path, prefetch_batches=ahead), model=tiny_model())
    pulled = []
    lock = threading.Lock()

    class Loader:  # what the train source reads of a loader
        steps_per_epoch = 20

        def batches(self, start_step=0, with_stats=False):
            for i in range(start_step, 20):
                with lock:
                    pulled.append(i)
                yield {"input_ids": np.full((1, 4, 8), i, np.int32)}, None

    source = LoaderSource(Loader(), trainer.sharding_plan.batch, prefetch_batches=ahead)
    source.open(0)
    try:
        first = source.next(0)
        assert int(first.batch["input_ids"][0, 0, 0]) == 0 and first.host["input_ids"].shape == (
            1,
            4,
            8,
        )
        deadline, seen = time.monotonic() + 10, -1
        while time.monotonic() < deadline:  # until the reader stops for lack of room
            time.sleep(0.2)
            with lock:
                now = len(pulled)
            if now == seen:
                break
            seen = now
        assert seen == 2 + ahead
    finally:
        source.close()


# ------------------------------------------------------------ 4: pad token fallback
def test_a_tokenizer_without_pad_pads_with_eos_and_says_so(tmp_path, caplog):
    tokenizer = word_tokenizer(eos_token="</s>")
    assert tokenizer.pad_token_id is None
    with caplog.at_level(logging.WARNING, logger="jaxtrain.data"):
        trainer = Trainer(
            arguments=args(tmp_path),
            model=tiny_model(),
            dataset_train=ragged_rows(),
            processing_class=tokenizer,
        )
    assert trainer.pad_token_id == tokenizer.eos_token_id == 1
    assert "no pad token: padding with its eos token id 1" in caplog.text
    batch, _ = trainer.train_source.loader.batch_at(0)
    ids, labels = np.asarray(batch["input_ids"]), np.asarray(batch["labels"])
    padded = labels == -100
    assert padded.any() and (ids[padded[..., :]] == 1).all()


def test_a_tokenizer_without_pad_or_eos_is_an_error(tmp_path):
    with pytest.raises(ArgumentError, match="neither a pad token nor an eos token"):
        Trainer(
            arguments=args(tmp_path),
            model=tiny_model(),
            dataset_train=ragged_rows(),
            processing_class=word_tokenizer(),
        )


# ------------------------------------------------------------ 5 and 6: two devices
TWO_DEVICES = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import jax
from test_first_run import args, ragged_rows, tiny_model
from jaxtrain import Trainer
from jaxtrain.errors import MeshError
out = Path({out!r})
try:
    Trainer(arguments=args(out, sharding_axis_dims=(1, 1, 2, 1, 1)), model=tiny_model(),
            dataset_train=ragged_rows())
except MeshError as err:
    print("MeshError:", err)
# A mesh over one of the two devices: the start-up line counts the mesh's devices.
Trainer(arguments=args(out, max_steps=1, warmup_steps=0, save_final=False, sharding_axis_dims=(1, 1, 1, 1, 1)),
        model=tiny_model(), dataset_train=ragged_rows(), devices=jax.devices()[:1]).train()
"""


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory) -> subprocess.CompletedProcess:
    code = TWO_DEVICES.format(
        tests=os.path.dirname(__file__), out=str(tmp_path_factory.mktemp("two"))
    )
    env = {
        **os.environ,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_expert_parallel_on_a_model_without_experts_is_an_error(two_devices):
    assert "MeshError: sharding_axis_dims=(1, 1, 2, 1, 1) sets ep=2" in two_devices.stdout
    assert "--sharding_axis_dims 1,2,1,1,1" in two_devices.stdout
    assert MeshError.exit_code == 2


def test_the_start_up_line_counts_the_mesh_devices(two_devices):
    assert "devices: 1 x cpu" in two_devices.stderr, two_devices.stderr[-2000:]


def test_progress_bars_become_plain_lines_outside_a_terminal():
    stream = io.StringIO()  # not a TTY, like a log file or a pipe
    for kind in ("rich", "tqdm"):
        progress = make_progress(kind, 10, stream=stream)
        progress.update(3)  # an unlogged step prints nothing
        progress.update(5, {"loss": 2.5, "tok/s": 1234.0})
        progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("train 5/10 eta ") for line in lines)
    assert lines[0].endswith("loss=2.5 tok/s=1,234") and "\r" not in stream.getvalue()


@pytest.mark.parametrize("kind", ["rich", "tqdm"])
def test_a_160_column_terminal_shows_lr_throughput_and_mfu(kind, monkeypatch):
    """The demo's fields, at their widest (a 5-digit step count, a long lr), fit 160 columns."""
    import re
    import time

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "160")
    stream = Terminal()
    progress = make_progress(kind, 20000, stream=stream)
    fields = {"epoch": 12.34, "loss": 4.123456, "lr": 0.000299999, "tok/s": 123456.7}
    progress.update(10000, {**fields, "mfu": "12.3%"})
    time.sleep(0.3)  # rich redraws 4 times a second
    progress.close()
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue()).replace("\r", "\n")
    line = [text for text in last.splitlines() if "10000/20000" in text or "10000/" in text][-1]
    assert len(line.rstrip()) <= 160, line
    for shown in ("lr=0.0003", "tok/s=123,457", "mfu=12.3%"):
        assert shown in line, (shown, line)


# ------------------------------------------------------------ the command line
def jaxtrain(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    code = "import sys; from jaxtrain.cli import main; raise SystemExit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    "flags, words",
    [
        # issue 16.1 / 17.3: the demo's warmup (30) does not fit a 20-step run
        (["--max_steps", "20"], "warmup_steps=30 must be smaller than the run's 20 steps"),
        (["--warmup_steps", "30", "--max_steps", "4"], "warmup_steps=30"),
        # issue 17.1: misspelled section keys get a suggestion, like top-level flags
        (["--model.hiden_size", "32"], "model.hiden_size (did you mean model.hidden_size?)"),
        (["--data.vocab_sise", "32"], "data.vocab_sise (did you mean data.vocab_size?)"),
        (["--sample.max_new_token", "3"], "(did you mean sample.max_new_tokens?)"),
        # A flag's typo is said to be the command line's (once "in config", with a note that
        # the suggested field's value came from the demo's settings).
        (
            ["--learning_rat", "1e-3"],
            "field(s) in the command line: 'learning_rat' (did you "
            "mean 'learning_rate'?). Remove them or fix the spelling.",
        ),
        # issue 17.2: an inconsistent architecture is one line, before any data is read
        (
            ["--model.hidden_size", "30", "--model.num_attention_heads", "4"],
            "model section: hidden_size (30) is not divisible by num_attention_heads (4)",
        ),
    ],
)
def test_bad_values_exit_2_with_one_line_before_anything_is_written(tmp_path, capsys, flags, words):
    run = tmp_path / "run"
    code = main(["train", "--output_dir", str(run), *flags])  # the CLI's own entry point
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert words in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert not run.exists()


# ------------------------------------------------------------ 10: quiet file loading
def test_reading_files_prints_no_datasets_progress(tmp_path, capfd):
    from datasets.utils import logging as ds_logging

    from jaxtrain.data.files import load_files

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(20)))
    assert ds_logging.is_progress_bar_enabled()  # the user's setting, restored after
    rows = load_files(str(path), name="data.train_files")
    out, err = capfd.readouterr()
    assert len(rows) == 20 and "Generating" not in out + err and "%" not in out + err
    assert ds_logging.is_progress_bar_enabled()


# ------------------------------------------------------------ 11: what happens to the model
def test_the_trainer_documents_and_does_what_it_changes_on_the_model(tmp_path):
    model = tiny_model()
    assert model.remat_policy == "none"
    Trainer(
        arguments=args(tmp_path, dtype="bfloat16", gradient_checkpointing="dots_saveable"),
        model=model,
        dataset_train=ragged_rows(),
    )
    dtypes = {str(m.dtype) for _, m in nnx.iter_modules(model) if hasattr(m, "dtype")}
    assert model.remat_policy == "dots_saveable" and dtypes == {"bfloat16"}
    doc = " ".join(Trainer.__doc__.split())
    for words in ("changed in place", "compute `dtype` of every submodule", "`remat_policy`",
                  "holds the newest parameters"):  # fmt: skip
        assert words in doc


# ------------------------------------------------------------ 3: which settings apply
def test_a_config_file_starts_from_the_defaults_not_from_the_demo(tmp_path):
    from jaxtrain.cli.run_config import (
        DEFAULT_CONFIG,
        describe_sources,
        resolve_config_with_sources,
        split_config,
    )

    path = tmp_path / "mine.yaml"
    path.write_text("learning_rate: 0.01\nmax_steps: 50\nmodel: {hidden_size: 64}\n")
    config, sources = resolve_config_with_sources(str(path), {"total_batch_size": "8"})
    arguments, model, data, sample = split_config(config)
    defaults = TrainingArguments()
    for name in ("weight_decay", "warmup_steps", "max_sequence_length", "eval_steps"):
        assert getattr(arguments, name) == getattr(defaults, name), name
    assert model == {"hidden_size": 64} and data == {"source": "default"} and sample == {}
    text = describe_sources(config, sources)
    assert f"config from {path}: learning_rate=0.01, max_steps=50, model.hidden_size=64" in text
    assert "config from command line: total_batch_size=8" in text and "demo" not in text

    # No file: the command line adjusts the demo; --model.pretrained leaves it out too.
    config, sources = resolve_config_with_sources(None, {"max_steps": "100"})
    assert config["weight_decay"] == DEFAULT_CONFIG["weight_decay"] and sources["max_steps"]
    assert describe_sources(config, sources).startswith("config from demo: output_dir=")
    config, _ = resolve_config_with_sources(None, {"model.pretrained": "some/dir"})
    assert "weight_decay" not in config and config["model"] == {"pretrained": "some/dir"}


def test_an_error_in_a_demo_value_says_it_came_from_the_demo(capsys):
    assert main(["train", "--max_steps", "20"]) == 2
    err = capsys.readouterr().err
    assert "warmup_steps came from the demo's settings" in err and "--warmup_steps" in err


# ------------------------------------------------------------ 9: the end-of-run sample
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def test_the_sample_prompt_follows_the_runs_data_format():
    from jaxtrain.data.prompts import MAX_PROMPT_TOKENS, sample_prompt

    tokenizer = word_tokenizer(eos_token="</s>")
    chat = datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": "w3 w4"},
                    {"role": "assistant", "content": "w5"},
                ]
            }
        ]
    )
    ids, text = sample_prompt(tokenizer, chat, chat_template=CHAT_TEMPLATE)
    assert text == "<user> w3 w4 <assistant> " and "w5" not in text
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]

    ids, text = sample_prompt(tokenizer, ragged_rows())  # token rows: the first half of row 0
    row = ragged_rows()[0]["input_ids"]
    assert ids == row[: min(len(row) // 2, MAX_PROMPT_TOKENS)] and text == tokenizer.decode(ids)

    ids, text = sample_prompt(tokenizer, chat, prompt="w7 w8")  # set by the user: it wins
    assert text == "w7 w8" and ids == [7, 8]


# ------------------------------------------------------------ 12: help and version
def test_help_of_every_command_and_version(capsys):
    from dataclasses import fields

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "jaxtrain 0.1.0"
    for flag in ("--help", "-h"):
        assert main(["train", flag]) == 0
        text = capsys.readouterr().out
        lines = text.splitlines()
        for prefix, cls in (("", TrainingArguments), ("model.", LlamaConfig)):
            for f in fields(cls):
                (i,) = [
                    i for i, line in enumerate(lines) if line.startswith(f"  --{prefix}{f.name} ")
                ]
                assert "(default: " in lines[i], lines[i]
                assert lines[i + 1].startswith("      ") and len(lines[i + 1].strip()) > 8, f.name
        assert "  --learning_rate FLOAT  (default: 0.0003)" in text
        assert "  --data.train_files STR" in text and "  --sample.prompt STR" in text
    for command in ("eval", "sample", "export", "report"):
        assert main([command, "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: jaxtrain {command} ")

"""`jaxtrain train | eval | sample | export | report`: the command line.

`jaxtrain train` with no arguments trains the demo model on the embedded corpus.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

USAGE = """usage:
  jaxtrain train [CONFIG.yaml|json] [--field value ...] [--model.field value] [--data.field value]
                 [--dry_run]   (print mesh, per-device memory and parameter shardings; no training)
  jaxtrain eval RUN_DIR [--checkpoint PATH] [--max_eval_batches N]
  jaxtrain sample RUN_DIR [--prompt TEXT] [--max_new_tokens N] [--temperature T] [--top_p P]
  jaxtrain export RUN_OR_CHECKPOINT OUT_DIR [--max_shard_size 5GB] [--dtype bfloat16]
  jaxtrain report RUN_DIR   (writes RUN_DIR/report.png and report.html)
  jaxtrain --version

`jaxtrain COMMAND --help` (or -h) lists every option of COMMAND with its type, default and doc.

Every TrainingArguments field can be set in the config file or as --field value.
With no config, `jaxtrain train` trains a small Llama on the embedded corpus (the demo).
`--model.pretrained DIR` fine-tunes a local Hugging Face model; `export` writes one.
"""


COMMANDS = ("train", "eval", "sample", "export", "report")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("--version", "-V", "version"):
        from jaxtrain import __version__

        print(f"jaxtrain {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in COMMANDS and any(t in ("-h", "--help") for t in rest):
        from jaxtrain.cli_help import command_help

        print(command_help(command))
        return 0
    from jaxtrain import interrupts

    interrupts.install(f"jaxtrain {command}")  # Ctrl-C from here on: exit 130, no traceback
    return _dispatch(command, rest)


def _dispatch(command: str, rest: list[str]) -> int:
    from jaxtrain.errors import CheckpointError, JaxtrainError, TrainingInterrupted
    from jaxtrain.hf.cli import cmd_export

    commands = {
        "train": cmd_train,
        "eval": cmd_eval,
        "sample": cmd_sample,
        "export": cmd_export,
        "report": cmd_report,
    }
    if command not in commands:
        print(f"jaxtrain: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[command](rest)
    except JaxtrainError as err:
        # One place turns every deliberate error into its message and exit code; anything
        # else is a bug and keeps its traceback (exit 1).
        label = "" if isinstance(err, TrainingInterrupted) else "error: "
        print(f"jaxtrain {command}: {label}{err}", file=sys.stderr)
        if isinstance(err, CheckpointError):
            # Tensorstore reads or writes still in flight when Orbax gave up complete during
            # interpreter shutdown and print "Event loop is closed" tracebacks after this
            # line. Nothing here needs the exit hooks: the loop already closed the logs and
            # trackers, and a refused restore opened none.
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # their threads print nothing more
            os._exit(err.exit_code)
        return err.exit_code


def _split_positional(tokens: list[str]) -> tuple[str | None, list[str]]:
    if tokens and not tokens[0].startswith("--"):
        return tokens[0], tokens[1:]
    return None, tokens


# ---------------------------------------------------------------- building
def build_model(model_section: dict[str, Any], tokenizer, *, seed: int, sharding_for=None):
    """The model of a run's `model` section; `sharding_for` places pretrained weights."""
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    values = dict(model_section)
    base_model = values.pop("base_model", None)  # where a run's weights came from
    if "pretrained" in values:
        from jaxtrain.hf.cli import build_pretrained_model

        return build_pretrained_model(values, tokenizer, sharding_for=sharding_for)
    if tokenizer is not None:
        values.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, name, None) is not None:
                values.setdefault(name, getattr(tokenizer, name))
    config = LlamaConfig.from_dict(values)
    if tokenizer is not None and config.vocab_size < len(tokenizer):
        from jaxtrain.arguments import ArgumentError

        raise ArgumentError(
            f"model.vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({len(tokenizer)}). Set --model.vocab_size {len(tokenizer)} or larger."
        )
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
    if base_model:
        model.name_or_path = base_model
    return model


def build_data(data: dict[str, Any], seq_len: int):
    """-> (train dataset, eval dataset, tokenizer) from the `data` section."""
    from jaxtrain.arguments import ArgumentError

    source = data.get("source", "default")
    if source == "default":
        from jaxtrain.data import chunk_dataset, load_default_corpus

        kwargs = {k: data[k] for k in ("max_train_bytes", "vocab_size") if k in data}
        corpus = load_default_corpus(**kwargs)
        tokenizer = corpus.tokenizer
        if data.get("tokenizer"):  # e.g. a pretrained model's own tokenizer
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"], local_files_only=True)
        train = chunk_dataset(corpus.train, tokenizer, seq_len)
        evaluation = chunk_dataset(corpus.eval, tokenizer, seq_len)
        return train, evaluation, tokenizer
    if source == "files":
        if "train_files" not in data:
            raise ArgumentError("data.source='files' needs data.train_files (a path or glob).")
        tokenizer = None
        if data.get("tokenizer"):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(data["tokenizer"], local_files_only=True)
        train = _load_files(data["train_files"], "data.train_files")
        evaluation = (
            _load_files(data["eval_files"], "data.eval_files") if data.get("eval_files") else None
        )
        return train, evaluation, tokenizer
    raise ArgumentError(f"data.source={source!r} is not supported; use 'default' or 'files'.")


def _load_files(pattern: str, field: str):
    from jaxtrain.data.files import load_files

    return load_files(pattern, name=field)


def _load_run(run_dir: str):
    """Model, tokenizer, args, data and sample sections of a finished run directory."""
    from transformers import AutoTokenizer

    from jaxtrain.arguments import read_config_file
    from jaxtrain.run_config import split_config

    config = read_config_file(Path(run_dir) / "config.yaml")
    args, model_section, data, sample = split_config(config)
    tokenizer_dir = Path(run_dir) / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir.is_dir() else None
    return args, model_section, data, sample, tokenizer


def _latest_checkpoint(run_dir: str) -> str:
    from jaxtrain.checkpointing import find_checkpoint

    return str(find_checkpoint(run_dir))


# ---------------------------------------------------------------- commands
def cmd_train(tokens: list[str]) -> int:
    from jaxtrain.errors import ArgumentError
    from jaxtrain.run_config import (
        describe_sources,
        explain_source,
        parse_overrides,
        resolve_config_with_sources,
        save_config,
        split_config,
    )

    dry_run = "--dry_run" in tokens
    path, rest = _split_positional([t for t in tokens if t != "--dry_run"])
    config, sources = resolve_config_with_sources(path, parse_overrides(rest))
    try:
        args, model_section, data, sample = split_config(config)
    except ArgumentError as err:
        raise explain_source(err, sources) from None

    from jaxtrain import Trainer
    from jaxtrain.hf.cli import pretrained_data_section, run_model_section
    from jaxtrain.parallel import ModelFactory, ShardingPlan, initialize_distributed
    from jaxtrain.training.stopping import EXIT_OK, EXIT_TIME_LIMIT

    initialize_distributed(args)  # before anything touches a device
    import jax

    if jax.process_index() == 0:
        print(describe_sources(config, sources), flush=True)
    data = pretrained_data_section(model_section, data)
    train, evaluation, tokenizer = build_data(data, args.max_sequence_length)
    if "pretrained" in model_section:
        # Each tensor goes straight from the file to its shards on the mesh.
        plan = ShardingPlan.from_arguments(args)
        model = build_model(
            model_section, tokenizer, seed=args.seed, sharding_for=plan.sharding_for
        )
        section = run_model_section(model)
    else:
        # Built abstractly, then created already sharded on the mesh by the Trainer.
        model = ModelFactory(lambda: build_model(model_section, tokenizer, seed=args.seed))
        section = run_model_section(model.abstract())
    resolved = {**args.to_dict(), "model": section, "data": data, "sample": sample}

    class SaveConfig:
        # Written once the run owns output_dir (after resume checks), so an interrupted run
        # can be evaluated, sampled or resumed from its directory.
        def on_train_start(self, trainer: Any, state: Any) -> None:
            save_config(resolved, args.output_dir)

    trainer = Trainer(
        arguments=args,
        model=model,
        dataset_train=train,
        dataset_eval=evaluation,
        processing_class=tokenizer,
        callbacks=[SaveConfig()],
    )
    if dry_run:
        trainer.dry_run()
        return EXIT_OK
    output = trainer.train()
    summary = ", ".join(
        f"{k}={output.metrics[k]:.4f}" for k in ("loss", "eval/loss") if k in output.metrics
    )
    print(f"done ({output.stop_reason}): {summary}; checkpoint: {output.checkpoint_path}")
    if output.stop_reason == "time_limit":
        return EXIT_TIME_LIMIT
    if tokenizer is not None and sample.get("max_new_tokens", 64) > 0:
        _print_sample(trainer.model, tokenizer, sample, evaluation or train, args)
    return EXIT_OK


def _print_sample(model, tokenizer, sample: dict[str, Any], dataset=None, args=None) -> None:
    """A sample from `sample.prompt`, else a prompt in the run's own data format."""
    from jaxtrain.data.prompts import sample_prompt
    from jaxtrain.models import generate

    ids, prompt = sample_prompt(
        tokenizer,
        dataset,
        prompt=sample.get("prompt"),
        messages_column=getattr(args, "messages_column", "messages"),
        text_column=getattr(args, "text_column", "text"),
        chat_template=getattr(args, "chat_template", None),
    )
    new = generate(
        model,
        ids,
        max_new_tokens=sample.get("max_new_tokens", 64),
        temperature=sample.get("temperature", 0.0),
        top_k=sample.get("top_k"),
        top_p=sample.get("top_p", 1.0),
        eos_token_id=tokenizer.eos_token_id,
    )
    print("--- sample " + "-" * 50)
    print(prompt + tokenizer.decode(list(new), skip_special_tokens=True))
    print("-" * 61)


def _restore_run(tokens: list[str], *, with_eval_data: bool):
    """Parse `RUN_DIR [--checkpoint PATH] [--options]` and rebuild trainer and state.

    -> (trainer, state, checkpoint path, sample section, tokenizer, leftover options)
    """
    from jaxtrain import Trainer
    from jaxtrain.arguments import ArgumentError
    from jaxtrain.run_config import parse_overrides

    run_dir, rest = _split_positional(tokens)
    if run_dir is None:
        raise ArgumentError(f"missing RUN_DIR.\n\n{USAGE}")
    overrides = parse_overrides(rest)
    checkpoint = overrides.pop("checkpoint", None) or _latest_checkpoint(run_dir)
    args, model_section, data, sample, tokenizer = _load_run(run_dir)
    from jaxtrain.parallel import initialize_distributed

    initialize_distributed(args)  # before the model touches a device
    evaluation = build_data(data, args.max_sequence_length)[1] if with_eval_data else None
    model = build_model(model_section, tokenizer, seed=args.seed)
    trainer = Trainer(arguments=args, model=model, dataset_eval=evaluation)
    state = trainer.load_checkpoint(checkpoint)
    return trainer, state, checkpoint, sample, tokenizer, overrides


def cmd_eval(tokens: list[str]) -> int:
    from jaxtrain.arguments import ArgumentError, coerce_value

    trainer, state, checkpoint, _, _, overrides = _restore_run(tokens, with_eval_data=True)
    if "max_eval_batches" in overrides:
        raw = overrides.pop("max_eval_batches")
        trainer.arguments.max_eval_batches = coerce_value(
            int | None, raw, field="max_eval_batches", source="command line"
        )
    if overrides:
        raise ArgumentError(f"jaxtrain eval: unknown option(s) {sorted(overrides)}.")
    metrics = trainer.evaluate(state)
    print(f"checkpoint: {checkpoint}")
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


def cmd_sample(tokens: list[str]) -> int:
    from jaxtrain.arguments import ArgumentError
    from jaxtrain.run_config import SAMPLE_KEYS, typed_section

    trainer, state, _, sample, tokenizer, overrides = _restore_run(tokens, with_eval_data=False)
    sample = {**sample, **typed_section(overrides, SAMPLE_KEYS, "sample")}
    if tokenizer is None:
        raise ArgumentError("the run directory has no tokenizer/ to encode the prompt.")
    _print_sample(trainer.model_from_state(state), tokenizer, sample)
    return 0


def cmd_report(tokens: list[str]) -> int:
    from jaxtrain.arguments import ArgumentError
    from jaxtrain.observability.report import write_report

    if len(tokens) != 1 or tokens[0].startswith("--"):
        raise ArgumentError(f"jaxtrain report takes one RUN_DIR.\n\n{USAGE}")
    report = write_report(tokens[0])
    print(f"report: {report.png} and {report.html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`jaxtrain train | eval | sample | report`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from jaxtrain.cli.usage import USAGE, split_positional
from jaxtrain.errors import EXIT_OK, EXIT_TIME_LIMIT, ArgumentError, OutOfMemoryError


def cmd_train(
    tokens: list[str], callbacks: list[Any] | None = None, own_process: bool = False
) -> int:
    """`jaxtrain train`; `callbacks` join the Trainer's (jaxtrain tune reports through one);
    `own_process`: the process is the command's (its entry point: collector.freeze_the_heap)."""
    from jaxtrain.cli.pretrained import pretrained_data_section, run_model_section
    from jaxtrain.cli.run_config import (
        describe_sources,
        explain_source,
        parse_overrides,
        resolve_config_with_sources,
        save_config,
        section_changes,
        split_config,
        typed_model_section,
    )
    from jaxtrain.cli.run_dir import build_data, build_model

    dry_run = "--dry_run" in tokens
    path, rest = split_positional([t for t in tokens if t != "--dry_run"])
    config, sources = resolve_config_with_sources(path, parse_overrides(rest))
    from jaxtrain.tasks import DEFAULT_TASK, get_task, trainer_setup

    task = str(config.get("task") or DEFAULT_TASK)
    try:
        definition = get_task(task)  # an unknown task is the config's error too
        args, model_section, data, sample = split_config(
            config,
            path or "the command line",
            sources,
            task_check=definition.check_data,
        )
    except ArgumentError as err:
        raise explain_source(err, sources) from None

    from jaxtrain.parallel import ModelFactory
    from jaxtrain.runtime import Runtime

    runtime = Runtime.from_arguments(args)  # before anything touches a device
    if runtime.is_main_process:
        print(describe_sources(config, sources), flush=True)
        if sample and not definition.generates:  # said, not refused: a shared config
            print(
                f"jaxtrain: --task {task} writes no text, so its sample section "
                f"({', '.join(sorted(sample))}) is not used.",
                flush=True,
            )
    data = pretrained_data_section(model_section, data)
    train, evaluation, tokenizer = build_data(data, args.max_sequence_length, args.packing)
    if "pretrained" in model_section:
        # Each tensor goes straight from the file to its shards on the mesh (a QLoRA base's
        # quantized on the way).
        from jaxtrain.cli.pretrained import pretrained_load_options

        model = build_model(
            model_section,
            tokenizer,
            seed=args.seed,
            sharding_for=runtime.plan.sharding_for,
            load_options=pretrained_load_options(args),
        )
        section = run_model_section(model)
    else:
        # Built abstractly, then created already sharded on the mesh by the Trainer.
        model = ModelFactory(lambda: build_model(model_section, tokenizer, seed=args.seed))
        section = run_model_section(model.abstract())
    resolved = {**args.to_dict(), "model": section, "data": data, "sample": sample}
    trainer_class, task_kwargs, task_config = trainer_setup(
        task, config, data, tokenizer, args, build_model, typed_model_section
    )
    resolved.update(task_config)

    class SaveConfig:
        # Written once the run owns output_dir (after resume checks), so an interrupted run
        # can be evaluated, sampled or resumed from its directory.
        def on_train_start(self, trainer: Any, state: Any) -> None:
            import jax

            from jaxtrain.config_values import read_config_file

            saved = Path(args.output_dir) / "config.yaml"
            step = int(jax.device_get(state.step))
            if step and saved.is_file() and runtime.is_main_process:  # a resumed run
                changed = section_changes(read_config_file(saved), resolved, definition.sections)
                if changed:
                    print(
                        "jaxtrain: this run's task sections differ from the "
                        f"checkpoint's run ({changed}): from step {step + 1} on it trains "
                        "with this run's",
                        flush=True,
                    )
            save_config(resolved, args.output_dir)

    trainer = trainer_class(
        arguments=args,
        model=model,
        dataset_train=train,
        dataset_eval=evaluation,
        processing_class=tokenizer,
        callbacks=[SaveConfig(), *(callbacks or [])],
        runtime=runtime,
        **task_kwargs,
    )
    if dry_run:
        trainer.dry_run()
        return EXIT_OK
    if own_process:
        from jaxtrain.cli.collector import freeze_the_heap

        freeze_the_heap()
    try:
        output = trainer.train()
    except OutOfMemoryError as err:
        raise _with_fits(err, trainer, task, model_section) from None
    summary = ", ".join(
        f"{k}={output.metrics[k]:.4f}" for k in ("loss", "eval/loss") if k in output.metrics
    )
    speaks = runtime.is_main_process  # the other processes of a cluster stay quiet
    if speaks:
        print(f"done ({output.stop_reason}): {summary}; checkpoint: {output.checkpoint_path}")
    if output.stop_reason == "time_limit":
        return EXIT_TIME_LIMIT
    if tokenizer is not None and sample.get("max_new_tokens", 64) > 0 and definition.generates:
        # The trained causal LM (a task trainer's policy or student), not the task's container.
        model = trainer.model_from_state(output.state)
        try:
            print_sample(model, tokenizer, sample, evaluation or train, args, quiet=not speaks)
        except Exception as err:  # noqa: BLE001 - the run is done; its sample is a courtesy
            # Training and the final checkpoint succeeded: a sample that fails says why in one
            # line and leaves the exit code of the finished run alone.
            if speaks:
                print(
                    f"jaxtrain train: the end-of-run sample failed ({type(err).__name__}: "
                    f"{err}); the run itself finished. Try `jaxtrain sample "
                    f"{args.output_dir}` with other --sample options.",
                    file=sys.stderr,
                )
    return EXIT_OK


def sample_top_k(model: Any, tokenizer: Any, top_k: int | None) -> tuple[int | None, str | None]:
    """(top_k clamped to the model's vocabulary, a note saying so when it was clamped)."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) or len(tokenizer)
    if top_k is None or top_k < vocab:
        return top_k, None
    return vocab, (
        f"sample: top_k {top_k} is not below the vocabulary's {vocab} tokens: sampling from "
        f"all {vocab} (set --sample.top_k below {vocab} to restrict the draw)"
    )


def _with_fits(err: OutOfMemoryError, trainer: Any, task: str, model: dict) -> OutOfMemoryError:
    """The out-of-memory line with settings that would fit, found by compiling the run's
    step with one change each (planning/fit.py). Only for what plan compiles: a language
    model's own objective (the default task), without LoRA, in one process (every process
    would compile)."""
    from jaxtrain.tasks import DEFAULT_TASK

    args = trainer.arguments
    if task != DEFAULT_TASK or args.lora_rank or trainer.runtime.process_count > 1:
        return err
    from jaxtrain.planning.fit import search_fits

    print(
        f"jaxtrain: step {err.step} ran out of device memory; compiling it with other "
        "settings to find some that fit",
        flush=True,
    )
    return search_fits(
        err,
        trainer.model_config,
        args,
        list(trainer.mesh.devices.flat),
        dict(trainer.mesh.shape),
        attention=model.get("attention_implementation"),
    )


def print_sample(
    model: Any,
    tokenizer: Any,
    sample: dict[str, Any],
    dataset: Any = None,
    args: Any = None,
    *,
    quiet: bool = False,
) -> None:
    """A sample from `sample.prompt`, else a prompt in the run's own data format. `quiet`:
    generate (every process of a cluster takes part) but print nothing."""
    from jaxtrain.data.prompts import sample_prompt, vision_sample_prompt
    from jaxtrain.data.vision import is_processor, text_tokenizer
    from jaxtrain.models import generate
    from jaxtrain.trainers.tools import shown_tools

    messages_column = getattr(args, "messages_column", "messages")
    chat_template = getattr(args, "chat_template", None)
    pixel_values = None
    if is_processor(tokenizer):  # a vision-language model: its prompt may hold an image
        ids, prompt, images = vision_sample_prompt(
            tokenizer, dataset, prompt=sample.get("prompt"), image=sample.get("image"),
            messages_column=messages_column, chat_template=chat_template,
        )  # fmt: skip
        pixel_values = None if images is None else images[None]
        tokenizer = text_tokenizer(tokenizer)
    elif sample.get("image") is not None:
        raise ArgumentError(
            "sample.image: this run's model takes no images (its tokenizer/ holds no image "
            "processor); drop the image."
        )
    else:
        ids, prompt = sample_prompt(
            tokenizer, dataset, prompt=sample.get("prompt"), messages_column=messages_column,
            text_column=getattr(args, "text_column", "text"), chat_template=chat_template,
            tools=shown_tools(getattr(args, "tools", None), getattr(args, "environment", None)),
        )  # fmt: skip
    top_k, note = sample_top_k(model, tokenizer, sample.get("top_k"))
    temperature = sample.get("temperature", 0.0)
    new = generate(
        model,
        ids,
        max_new_tokens=sample.get("max_new_tokens", 64),
        temperature=temperature,
        top_k=top_k,
        top_p=sample.get("top_p", 1.0),
        eos_token_id=tokenizer.eos_token_id,
        pixel_values=pixel_values,
    )
    if quiet:
        return
    if note is not None and temperature > 0:  # greedy decoding reads no top_k
        print(note)
    print("--- sample " + "-" * 50)
    print(prompt + tokenizer.decode(list(new), skip_special_tokens=True))
    print("-" * 61)


def _restore(tokens: list[str], *, with_eval_data: bool, check: Any = None):
    """`RUN_DIR [--checkpoint PATH] [--sharding_axis_dims DIMS] [--options]` -> (restored run,
    leftover options);
    `check(options)`, when given, reads the options (their values checked) before anything is
    restored."""
    from jaxtrain.cli.run_config import parse_overrides
    from jaxtrain.cli.run_dir import restore_run

    run_dir, rest = split_positional(tokens)
    if run_dir is None:
        raise ArgumentError(f"missing RUN_DIR.\n\n{USAGE}")
    overrides = parse_overrides(rest)
    checkpoint = overrides.pop("checkpoint", None)
    dims = overrides.pop("sharding_axis_dims", None)  # default: the run's, where it fits
    if check is not None:
        overrides = check(overrides)
    run = restore_run(run_dir, checkpoint, with_eval_data=with_eval_data, sharding_axis_dims=dims)
    return run, overrides


def cmd_eval(tokens: list[str]) -> int:
    from jaxtrain.config_values import coerce_value

    limit = None

    def checked(overrides: dict) -> dict:
        """The options, before anything loads."""
        nonlocal limit
        overrides = dict(overrides)
        if "max_eval_batches" in overrides:
            raw = overrides.pop("max_eval_batches")
            limit = coerce_value(int | None, raw, field="max_eval_batches", source="command line")
            if limit is not None and limit <= 0:  # it evaluated nothing and exited 0
                raise ArgumentError(
                    f"--max_eval_batches must be a positive number of batches, got {limit}; "
                    "leave it out for the run's own."
                )
        if overrides:
            raise ArgumentError(f"jaxtrain eval: unknown option(s) {sorted(overrides)}.")
        return overrides

    run, _ = _restore(tokens, with_eval_data=True, check=checked)
    trainer = run.trainer
    if not trainer.evaluates:
        raise ArgumentError(
            "this run has no eval set: its data section has no eval_files (and the run no "
            "eval_tasks). Score it with `jaxtrain evaluate RUN_DIR --tasks ...`."
        )
    metrics = trainer.evaluate(run.state, limit)
    print(f"checkpoint: {run.checkpoint}")
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return EXIT_OK


def cmd_sample(tokens: list[str]) -> int:
    from jaxtrain.cli.run_config import SAMPLE_KEYS, check_sample_section, typed_section

    def checked(options: dict[str, str]) -> dict[str, Any]:
        """The options typed and checked (they once reached the generator unchecked: a
        traceback after the model loaded)."""
        given = typed_section(options, SAMPLE_KEYS, "sample")
        check_sample_section(given, flag="--")
        if given.get("max_new_tokens") == 0:
            raise ArgumentError(
                "--max_new_tokens must be >= 1 to sample, e.g. --max_new_tokens 64."
            )
        return given

    run, given = _restore(tokens, with_eval_data=False, check=checked)
    if not run.sections.task.generates:
        raise ArgumentError(
            "jaxtrain sample: this run trained a reward model, which scores text and does not "
            "generate it. Use `jaxtrain eval RUN_DIR` for its pair accuracy (on the run's "
            "data.eval_files), or `jaxtrain export` for a sequence-classification model."
        )
    sample = {**run.sections.sample, **given}
    tokenizer = run.sections.tokenizer
    if tokenizer is None:
        raise ArgumentError("the run directory has no tokenizer/ to encode the prompt.")
    dataset = None
    if sample.get("prompt") is None:
        # The end-of-run sample's prompt: the first row of the run's eval (else train) data.
        from jaxtrain.cli.run_dir import build_data

        train, evaluation, _ = build_data(run.sections.data, run.sections.args.max_sequence_length)
        dataset = evaluation if evaluation is not None else train
    model = run.model()
    print_sample(model, tokenizer, sample, dataset, run.sections.args)
    return EXIT_OK


def cmd_report(tokens: list[str]) -> int:
    from jaxtrain.observability.report import write_report

    if len(tokens) != 1 or tokens[0].startswith("--"):
        raise ArgumentError(f"jaxtrain report takes one RUN_DIR.\n\n{USAGE}")
    report = write_report(tokens[0])
    print(f"report: {report.png} and {report.html}")
    return EXIT_OK

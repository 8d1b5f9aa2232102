"""A run's pieces from its sections or its directory: model, data, and a restored Trainer.

`jaxtrain train` builds a model and data from the resolved config; `eval`, `sample` and
`export` rebuild the same from `<run_dir>/config.yaml` and restore a checkpoint into it.
These are public so scripts can do the same as the CLI.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError, first_sentences


def build_model(
    model_section: dict[str, Any],
    tokenizer: Any,
    *,
    seed: int,
    sharding_for=None,
    load_options: dict[str, Any] | None = None,
):
    """The model of a run's `model` section; `sharding_for` places pretrained weights,
    `load_options` say how they are read (cli/pretrained.py pretrained_load_options)."""
    from flax import nnx

    from jaxtrain.models.attention import IMPLEMENTATIONS
    from jaxtrain.models.classes import classes_for

    values = dict(model_section)
    base_model = values.pop("base_model", None)  # where a run's weights came from
    attention = values.pop("attention_implementation", None)
    if attention not in IMPLEMENTATIONS:
        raise ArgumentError(
            f"model.attention_implementation={attention!r}: choose one of "
            f"{[i for i in IMPLEMENTATIONS if i]} (or leave it unset: blockwise for long rows)."
        )
    if "pretrained" in values:
        from jaxtrain.cli.pretrained import build_pretrained_model

        model = build_pretrained_model(values, tokenizer, sharding_for, load_options)
        return _with_attention(model, attention)
    if tokenizer is not None:
        values.setdefault("vocab_size", len(tokenizer))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(tokenizer, name, None) is not None:
                values.setdefault(name, getattr(tokenizer, name))
    config_class, model_class = classes_for(values.get("model_type"))  # MoE, Gemma, Llama
    config = config_class.from_dict(values)
    if tokenizer is not None and config.vocab_size < len(tokenizer):
        raise ArgumentError(
            f"model.vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({len(tokenizer)}). Set --model.vocab_size {len(tokenizer)} or larger."
        )
    model = model_class(config, rngs=nnx.Rngs(seed))
    if base_model:
        model.name_or_path = base_model
    return _with_attention(model, attention)


def _with_attention(model: Any, attention: str | None) -> Any:
    if attention is not None:
        model.attention_implementation = attention
    return model


def build_data(data: dict[str, Any], seq_len: int, packing: bool = False):
    """-> (train dataset, eval dataset, tokenizer) from the `data` section. The embedded
    corpus's eval split is rows of `seq_len` tokens cut from its files joined; so is its train
    split, unless `packing`: then its files' text, which the Trainer packs with a segment per
    file. Packed and unpacked runs evaluate the same rows."""
    source = data.get("source", "default")
    if "mixture" in data:  # the train data: a weighted mixture of files
        return _mixture_data(data)
    if source == "default":
        from jaxtrain.data import chunk_dataset, load_default_corpus

        kwargs = {k: data[k] for k in ("max_train_bytes", "vocab_size") if k in data}
        corpus = load_default_corpus(**kwargs)
        if data.get("tokenizer"):  # e.g. a pretrained model's own tokenizer
            tokenizer = data_tokenizer(data["tokenizer"])
            train = corpus.train if packing else chunk_dataset(corpus.train, tokenizer, seq_len)
            return train, chunk_dataset(corpus.eval, tokenizer, seq_len), tokenizer
        train = corpus.train if packing else corpus.token_rows("train", seq_len)
        return train, corpus.token_rows("eval", seq_len), corpus.tokenizer
    if source == "files":
        from jaxtrain.data.files import load_files

        if "train_files" not in data:
            raise ArgumentError("data.source='files' needs data.train_files (a path or glob).")
        tokenizer = data_tokenizer(data["tokenizer"]) if data.get("tokenizer") else None
        train = load_files(data["train_files"], name="data.train_files")
        evaluation = (
            load_files(data["eval_files"], name="data.eval_files")
            if data.get("eval_files")
            else None
        )
        return train, evaluation, tokenizer
    raise ArgumentError(f"data.source={source!r} is not supported; use 'default' or 'files'.")


def _mixture_data(data: dict[str, Any]):
    """-> ({name: Source}, eval dataset, tokenizer) of `data.mixture`."""
    from jaxtrain.data import Source
    from jaxtrain.data.files import load_files

    tokenizer = data_tokenizer(data["tokenizer"]) if data.get("tokenizer") else None
    train = {}
    for entry in data["mixture"]:
        name = entry["name"]
        settings = {k: v for k, v in entry.items() if k not in ("name", "files", "weight")}
        rows = load_files(entry["files"], name=f"data.mixture[{name!r}].files",
                          streaming=bool(entry.get("streaming")))  # fmt: skip
        train[name] = Source(rows, **settings)
    evaluation = (
        load_files(data["eval_files"], name="data.eval_files") if data.get("eval_files") else None
    )
    return train, evaluation, tokenizer


def data_tokenizer(path: str) -> Any:
    """The tokenizer of `data.tokenizer` (a directory, or a .gguf file's own)."""
    from jaxtrain.hf.load import gguf_path, load_tokenizer, looks_local
    from jaxtrain.hf.tokenizer_files import load_processing_class

    if gguf_path(path) is not None:  # `model.pretrained` a .gguf: its own tokenizer
        return load_tokenizer(path)
    if (
        looks_local(path) and not Path(path).expanduser().is_dir()
    ):  # a hub id may still sit in the local HF cache
        raise ArgumentError(
            f"data.tokenizer={path!r}: no such directory. Pass the local directory of a Hugging "
            "Face tokenizer (tokenizer.json or tokenizer_config.json)."
        )
    try:
        return load_processing_class(Path(path).expanduser())
    except Exception as err:  # transformers' many ways to say it found no tokenizer there
        reason = first_sentences(str(err).strip() or type(err).__name__)
        raise ArgumentError(
            f"data.tokenizer={path!r} (model.pretrained's unless set): no tokenizer or processor "
            f"loads from it ({reason}). Pass the local directory of a Hugging Face tokenizer "
            "(tokenizer.json or tokenizer_config.json), or a .gguf file."
        ) from err


@dataclass
class RunSections:
    """What `<run_dir>/config.yaml` (and tokenizer/) describe."""

    args: Any  # TrainingArguments, or the task's arguments class (DPOArguments, ...)
    model: dict[str, Any]
    data: dict[str, Any]
    sample: dict[str, Any]
    tokenizer: Any
    config: dict[str, Any]  # the whole file: its task and the task's sections (teacher)

    @functools.cached_property
    def settings(self) -> RunSettings:
        """The run's sections, built once from `args`."""
        return RunSettings.from_arguments(self.args)

    @property
    def task(self) -> Any:
        """The run's task definition (jaxtrain.tasks.Task)."""
        from jaxtrain.tasks import DEFAULT_TASK, get_task

        return get_task(str(self.config.get("task") or DEFAULT_TASK))


def python_run_error(run_dir: str | Path) -> ArgumentError | None:
    """The error for a Trainer run started from Python (arguments.json, no config.yaml),
    which the command line cannot rebuild; None for any other directory."""
    run_dir = Path(run_dir)
    if (run_dir / "config.yaml").is_file() or not (run_dir / "arguments.json").is_file():
        return None
    return ArgumentError(
        f"{run_dir} is a run started from Python: its model and data were Python objects, "
        "which the command line cannot rebuild (it has no config.yaml). In Python, `state = "
        "trainer.load_checkpoint(path)` then `trainer.evaluate(state)` or "
        "`trainer.save_pretrained(state, DIR)`; an exported DIR works with `jaxtrain serve "
        "DIR`, `jaxtrain evaluate DIR` and `--model.pretrained DIR`."
    )


def load_run(run_dir: str | Path) -> RunSections:
    """Arguments, model, data and sample sections and the tokenizer of a run directory."""
    from jaxtrain.arguments import read_config_file
    from jaxtrain.cli.run_config import split_config
    from jaxtrain.hf.tokenizer_files import load_processing_class

    config_path = Path(run_dir) / "config.yaml"
    if not config_path.is_file():
        raise python_run_error(run_dir) or ArgumentError(
            f"{run_dir} has no config.yaml: not a run directory written by `jaxtrain train`."
        )
    config = read_config_file(config_path)
    args, model_section, data, sample = split_config(config)
    tokenizer_dir = Path(run_dir) / "tokenizer"
    tokenizer = load_processing_class(tokenizer_dir) if tokenizer_dir.is_dir() else None
    return RunSections(args, model_section, data, sample, tokenizer, config)


def frozen_base_weights(sections: RunSections, *, frozen_parts: bool = True) -> str | None:
    """What of a run is not in its checkpoints but comes from its base model's weights: LoRA's
    frozen base, a task's reference (None: the checkpoint's parameters are the whole model).
    `frozen_parts=False`: the task's frozen models (a reference) are not wanted."""
    if sections.settings.model.lora_rank:
        return "LoRA's frozen base weights"
    if frozen_parts and sections.task.needs_base_weights(sections.settings):
        return f"{sections.task.name.upper()}'s reference model"
    return None


def rebuild_model(sections: RunSections, *, sharding_for: Any = None, frozen_parts: bool = True):
    """The run's model as training built it, before any checkpoint is restored into it.

    A run fine-tuned from a pretrained directory (`base_model` in its model section) is
    rebuilt from those weights: a checkpoint holds only the trained parameters, and frozen
    parts (LoRA's base, a task's reference) must be the base's, never a fresh random init. A base
    directory that is gone is an error when such parts need it (`frozen_parts=False`: the
    task's frozen models, a reference, are not).
    """
    from jaxtrain.cli.pretrained import pretrained_load_options, run_model_section

    section, seed = sections.model, sections.settings.model.seed
    base = section.get("base_model")
    if base and _base_is_present(base):
        model = build_model(
            {"pretrained": base},
            sections.tokenizer,
            seed=seed,
            sharding_for=sharding_for,
            load_options=pretrained_load_options(sections.args),
        )
        differ = sorted(k for k, v in run_model_section(model).items() if section.get(k, v) != v)
        if differ:
            raise ArgumentError(
                f"the base model {base} no longer matches the run's model section "
                f"({', '.join(differ)} differ): it changed since training. Restore its "
                "original files, or set model.base_model in the run's config.yaml to a copy."
            )
        return model
    needs = frozen_base_weights(sections, frozen_parts=frozen_parts)
    if base and needs:
        raise ArgumentError(
            f"this run was fine-tuned from {base}, and its {needs} come from that model's "
            "weights, which its checkpoints do not hold; that directory is gone. Put the base "
            "model back at that path, or set model.base_model in the run's config.yaml to "
            "where it is now."
        )
    return build_model(section, sections.tokenizer, seed=seed)


def _base_is_present(base: str) -> bool:
    from jaxtrain.errors import HFError
    from jaxtrain.hf.load import resolve_model_dir

    try:
        resolve_model_dir(base)  # a directory, or a hub id in the local HF cache
    except HFError:
        return False
    return True


@dataclass
class RestoredRun:
    """A run directory rebuilt: its trained model's Program, a restored state, where it came
    from, and (restored with its eval data) the run's task Trainer."""

    program: Any  # training.program.Program: the trained model and optimizer on the mesh
    state: Any  # TrainState
    checkpoint: str
    sections: RunSections
    trainer: Any = None  # the task's Trainer, when restore_run(with_eval_data=True)

    def model(self) -> Any:
        """The trained model (a task's policy, student or reward model) with the state's
        parameters."""
        return self.program.model_from_state(self.state)

    def save_pretrained(self, directory: str | Path, **kwargs: Any) -> Path:
        """The trained model as a Hugging Face directory of the task's kind (a causal LM; a
        sequence classifier for reward), as the run's trainer exports it; kwargs go to
        `jaxtrain.hf.save_pretrained` (max_shard_size, dtype, training_summary, ...)."""
        from jaxtrain.data.padding import resolve_pad_token_id
        from jaxtrain.hf.model_card import training_summary

        settings, tokenizer = self.sections.settings, self.sections.tokenizer
        kwargs.setdefault("tokenizer", tokenizer)
        kwargs.setdefault("chat_template", settings.data.chat_template)
        summary = training_summary(settings.monitor, self.model(), self.state)
        kwargs["training_summary"] = {**summary, **kwargs.get("training_summary", {})}
        pad = resolve_pad_token_id(tokenizer, self.program.parts.config)
        return self.sections.task.save_model(
            self.program, self.state, directory, pad_token_id=pad, **kwargs
        )


def step_directory(run_dir: str | Path, checkpoint: str | Path | None) -> Path | None:
    """`--checkpoint`: a step directory, or a step number of the run's (<run>/checkpoints/N)."""
    from jaxtrain.checkpointing import checkpoints_root

    if not checkpoint:
        return None
    if str(checkpoint).isdigit() and not Path(checkpoint).exists():
        return checkpoints_root(run_dir) / str(checkpoint)
    return Path(checkpoint)


def restore_run(
    run_dir: str | Path,
    checkpoint: str | Path | None = None,
    *,
    with_eval_data: bool = False,
    sharding_axis_dims: Any = None,
) -> RestoredRun:
    """Rebuild a finished (or interrupted) run's model and restore a checkpoint into it.

    The model is the run's task model without its frozen parts (`Task.model` of
    jaxtrain/tasks): what the checkpoint holds, all that sampling and export need, so neither
    the task's training data nor its frozen models (a reference, a teacher) are read.
    `with_eval_data` also rebuilds the run's task Trainer with the eval set (for `jaxtrain
    eval`: the task's data format, loss and frozen parts). `checkpoint` defaults to the
    run's newest committed checkpoint. The mesh is `sharding_axis_dims` when given, else
    the run's own where it fits the devices here, else one over them (restore_runtime).
    """
    from jaxtrain.checkpointing import find_checkpoint

    sections = load_run(run_dir)  # first: a directory that is no run is said so
    checkpoint = str(step_directory(run_dir, checkpoint) or find_checkpoint(run_dir))
    # Before the model touches a device; Orbax reads the arrays onto this mesh's shardings.
    runtime, sections = restore_runtime(
        sections, run_dir, sharding_axis_dims, for_eval=with_eval_data
    )
    if with_eval_data:
        trainer = _eval_trainer(sections, runtime)
        state = trainer.load_checkpoint(checkpoint)
        return RestoredRun(trainer.program, state, checkpoint, sections, trainer)
    from jaxtrain.training.program import ModelParts, Program
    from jaxtrain.training.trainer_checkpoints import load_program_state

    settings = sections.settings
    model = rebuild_model(sections, sharding_for=runtime.plan.sharding_for, frozen_parts=False)
    model = sections.task.model(lambda: model, settings, frozen=False)
    parts = ModelParts.adopt(model, settings.model)
    # The schedule's length does not change the optimizer state's structure.
    program = Program(parts, runtime, settings, schedule_length=max(settings.loop.max_steps, 1))
    state = load_program_state(
        program,
        checkpoint,
        optimizer=settings.optimizer.optimizer,
        trainer_name=sections.task.trainer.rpartition(":")[2],  # "module:Class" of the task's
    )
    return RestoredRun(program, state, checkpoint, sections)


def restore_runtime(
    sections: RunSections,
    run_dir: str | Path,
    sharding_axis_dims: Any = None,
    *,
    for_eval: bool = False,
) -> tuple[Any, RunSections]:
    """(the Runtime a run's checkpoint is restored in, the run's sections on its mesh).

    `sharding_axis_dims` when given (its errors stand, as a run's would). Else the run's own
    mesh where it fits the devices here, else all of them on fsdp, else one device
    (parallel/mesh.py restore_axis_dims), said in one line: a run trained on 4 devices is
    exported, sampled or evaluated on a machine with 1. `for_eval`: the mesh must split
    the run's eval batches too.
    """
    import jax

    from jaxtrain.config.tables import parse_axis_dims
    from jaxtrain.parallel.mesh import describe_restore, restore_axis_dims
    from jaxtrain.runtime import Runtime

    args = sections.args
    if sharding_axis_dims is not None:
        dims = parse_axis_dims(sharding_axis_dims)
        args = dataclasses.replace(args, sharding_axis_dims=dims)
        return Runtime.from_arguments(args), dataclasses.replace(sections, args=args)
    data, trained = sections.settings.data, _trained_devices(run_dir)
    notes: list[str] = []

    def choose(settings: Any, devices: list) -> tuple[Any, list]:
        run_dims = settings.sharding_axis_dims
        dims, count = restore_axis_dims(
            run_dims,
            len(devices),
            trained_devices=trained,
            rows=data.eval_batch_size if for_eval else None,
            seq_len=data.seq_len if for_eval else None,
            processes=jax.process_count(),
        )
        if (dims, count) != (run_dims, len(devices)):
            notes.append(describe_restore(run_dims, trained, dims, count, len(devices)))
        return dataclasses.replace(settings, sharding_axis_dims=dims), devices[:count]

    runtime = Runtime.from_arguments(args, choose_mesh=choose)
    if not notes:
        return runtime, sections
    if runtime.is_main_process:
        print(f"jaxtrain: {notes[0]}", file=sys.stderr, flush=True)
    # The arguments agree with the runtime (a Trainer checks that they do).
    args = dataclasses.replace(args, sharding_axis_dims=runtime.settings.sharding_axis_dims)
    return runtime, dataclasses.replace(sections, args=args)


def _trained_devices(run_dir: str | Path) -> int | None:
    """The devices the run's mesh spanned, from its run_info.json (None: not recorded)."""
    try:
        info = json.loads((Path(run_dir) / "run_info.json").read_text())
        return int(info["num_devices"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _eval_trainer(sections: RunSections, runtime: Any) -> Any:
    """The run's task Trainer over its eval set (no training data)."""
    from jaxtrain.cli.run_config import typed_model_section
    from jaxtrain.tasks import trainer_setup

    if sections.task.no_eval_set:
        raise ArgumentError(sections.task.no_eval_set)
    args, tokenizer = sections.args, sections.tokenizer
    model = rebuild_model(sections, sharding_for=runtime.plan.sharding_for)
    evaluation = build_data(sections.data, sections.settings.data.seq_len)[1]
    trainer_class, task_kwargs, _ = trainer_setup(
        sections.task.name,
        sections.config,
        sections.data,
        tokenizer,
        args,
        build_model,
        typed_model_section,
    )
    return trainer_class(
        arguments=args,
        model=model,
        dataset_eval=evaluation,
        processing_class=tokenizer,
        runtime=runtime,
        **task_kwargs,
    )

"""Build the train and eval loaders of a run from its DataSettings (used by the Trainer;
TrainingArguments are accepted too and read through DataSettings.from_arguments).

Every option is checked here, before anything is compiled. ``process_index`` and
``process_count`` select this host's share of the data (``jax.process_index()`` and
``jax.process_count()`` in a multi-host run); each host's batches are then
``[A, M // process_count, seq_len]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxtrain.config.mixture import check_mixture_names
from jaxtrain.config.sections import DataSettings
from jaxtrain.data.arrow_rows import ArrowRows
from jaxtrain.data.assemble import Collation, Collator
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.evaluation import EvalLoader
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.loader import BatchLoader, check_processes, prepare_source
from jaxtrain.data.mixture import BLOCK_STEPS, HISTORY, MixtureLoader, Source, source_seed
from jaxtrain.data.mixture_rows import row_reader
from jaxtrain.data.mixture_schedule import MixtureSchedule
from jaxtrain.data.scan import sample_scan, scan_tokens, warn_truncation
from jaxtrain.data.sources import IterableSource, RandomAccessSource, as_source, is_hf_dataset
from jaxtrain.data.streams import StreamUnits
from jaxtrain.data.unit_loader import UnitLoader
from jaxtrain.data.units import MapUnits
from jaxtrain.errors import ArgumentError

__all__ = ["build_eval_loader", "build_mixture_loader", "build_train_loader"]


# name -> a Featurizer for that dataset, or None for the default one (task trainers' rows).
FeaturizerFactory = Callable[[str], "Featurizer | None"]


# What a mixture's source may set for its own rows (data/mixture.py Source): featurizer
# attributes, taken from the source's DataSettings.
SOURCE_FEATURIZER_FIELDS = (
    "text_column",
    "messages_column",
    "completion_only_loss",
    "chat_template",
    "drop_columns",
)


def _featurizer(
    settings: DataSettings,
    tokenizer: Any,
    name: str,
    factory: FeaturizerFactory | None = None,
    vocab_size: int | None = None,
    own: tuple[str, ...] = (),
) -> Featurizer:
    """The featurizer of dataset `name`; `own`: fields the dataset sets for itself (a
    mixture's source), which a task's featurizer takes too."""
    custom = factory(name) if factory is not None else None
    if custom is not None:
        custom.vocab_size = custom.vocab_size or vocab_size
        for field in own:
            if not hasattr(custom, field):
                raise DatasetError(
                    f"{name} sets {field}, which this trainer's {type(custom).__name__} does "
                    "not read; drop it from the source"
                )
            setattr(custom, field, getattr(settings, field))
        return custom
    featurizer = Featurizer(
        name=name,
        tokenizer=tokenizer,
        text_column=settings.text_column,
        messages_column=settings.messages_column,
        completion_only_loss=settings.completion_only_loss,
        chat_template=settings.chat_template,
        drop_columns=settings.drop_columns,
    )
    featurizer.vocab_size = vocab_size  # each row's ids are checked against it as read
    return featurizer


def _collation(
    settings: DataSettings, collator: Collator | None, pad_token_id: int | None, name: str
) -> Collation:
    return Collation(
        name=name,
        seq_len=settings.seq_len,
        pad_token_id=pad_token_id,
        truncation_mode=settings.truncation_mode,
        collator=collator,
    )


def build_train_loader(
    settings: DataSettings | Any,
    dataset: Any,
    tokenizer: Any = None,
    collator: Collator | None = None,
    pad_token_id: int | None = 0,
    process_index: int = 0,
    process_count: int = 1,
    featurizer: FeaturizerFactory | None = None,
    vocab_size: int | None = None,
    *,
    name: str = "dataset_train",
    own: tuple[str, ...] = (),
) -> BatchLoader | UnitLoader:
    """A ``BatchLoader`` (random-access data, no packing) or a ``UnitLoader`` (packing or
    streaming). Raises DatasetError/ValueError naming what to fix. `vocab_size`: the
    model's; token ids are checked against it (the whole of a map-style dataset now).
    `name` is the dataset's in errors; `own`: featurizer fields it sets for itself."""
    settings = DataSettings.from_arguments(settings)
    check_processes(process_index, process_count, settings.micro_batch_size, "micro-batch size")
    source = as_source(dataset, name=name, streaming=settings.streaming)
    featurizer = _featurizer(settings, tokenizer, name, featurizer, vocab_size, own)
    if isinstance(source, RandomAccessSource):
        scan = scan_tokens(source, vocab_size=vocab_size, seq_len=settings.seq_len)
        if scan is None and collator is None and type(featurizer) is Featurizer:
            # Text or chat rows: tokenize a sample now, so the warning comes at the start.
            scan = sample_scan(source, featurizer, seq_len=settings.seq_len)
        if not (settings.packing and settings.split_long_documents):  # else long rows are split
            warn_truncation(
                scan, name=name, seq_len=settings.seq_len, mode=settings.truncation_mode,
                packing=settings.packing,
            )  # fmt: skip
    stream = isinstance(source, IterableSource)
    if not stream and not settings.packing:
        return BatchLoader(
            source,
            global_batch_size=settings.global_batch_size,
            accumulation_steps=settings.accumulation_steps,
            seq_len=settings.seq_len,
            pad_token_id=pad_token_id,
            truncation_mode=settings.truncation_mode,
            shuffle=settings.shuffle,
            seed=settings.seed,
            collator=collator or featurizer.collator,
            drop_last=settings.drop_last,
            process_index=process_index,
            process_count=process_count,
            name=name,
            featurizer=featurizer,
        )
    what = "streaming data" if stream else "packing=True"
    if not settings.fixed_length:
        raise DatasetError(
            f"{name} with {what} has no known number of steps per epoch; set "
            "max_steps (e.g. --max_steps 1000)"
        )
    if settings.epoch_evaluation:
        raise DatasetError(
            f"evaluation_strategy='epoch' needs a known epoch length, which {what} does not "
            "have; use evaluation_strategy='steps'"
        )
    prepare_source(source, featurizer)
    common = dict(
        seed=settings.seed,
        shuffle=settings.shuffle,
        process_index=process_index,
        process_count=process_count,
    )
    if stream:
        units: MapUnits | StreamUnits = StreamUnits(
            source, featurizer, window=settings.stream_window, **common
        )
    else:
        units = MapUnits(source, featurizer, **common)
    # Packed, the rows are the Packer's; a featurizer's collator only lends its image slots.
    rows_collator = featurizer.collator
    return UnitLoader(
        units,
        _collation(
            settings, collator or (None if settings.packing else rows_collator), pad_token_id, name
        ),
        image_slots=getattr(rows_collator, "image_slots", None),
        global_batch_size=settings.global_batch_size,
        accumulation_steps=settings.accumulation_steps,
        packing=settings.packing,
        packing_window=settings.packing_window,
        split_long_documents=settings.split_long_documents,
    )


def build_mixture_loader(
    settings: DataSettings | Any,
    sources: Mapping[str, Any],
    tokenizer: Any = None,
    collator: Collator | None = None,
    pad_token_id: int | None = 0,
    process_index: int = 0,
    process_count: int = 1,
    featurizer: FeaturizerFactory | None = None,
    vocab_size: int | None = None,
) -> MixtureLoader:
    """A MixtureLoader of `sources` ({name: dataset or Source}) by the settings' mixture
    weights: each source read by its own train loader (its settings: the run's, with what
    its Source sets), one row per process at a time (data/mixture.py)."""
    settings = DataSettings.from_arguments(settings)
    names = list(sources)
    if settings.mixture_stages is None:
        raise ArgumentError(
            f"dataset_train is a mapping of sources {names}: a mixture; give their weights, "
            f"e.g. mixture_weights={{{names[0]!r}: 0.5, ...}}."
        )
    check_mixture_names(settings.mixture_stages, names, "dataset_train")
    check_processes(process_index, process_count, settings.micro_batch_size, "micro-batch size")
    slots = settings.global_batch_size // process_count
    read_ahead = settings.prefetch_batches + 1
    readers = {}
    for name in names:
        given = sources[name]
        source = given if isinstance(given, Source) else Source(given)
        own = source.overrides()
        per_source = dataclasses.replace(
            settings,
            global_batch_size=process_count,  # one row per process per loader step
            accumulation_steps=1,
            seed=source_seed(settings.seed, name),
            fixed_length=True,  # the mixture's length is max_steps
            **own,
        )
        loader = build_train_loader(
            per_source, source.data, tokenizer, collator, pad_token_id, process_index,
            process_count, featurizer, vocab_size, name=f"dataset_train[{name!r}]",
            own=tuple(field for field in own if field in SOURCE_FEATURIZER_FIELDS),
        )  # fmt: skip
        readers[name] = row_reader(loader, history=(read_ahead + HISTORY + BLOCK_STEPS + 1) * slots)
    per_process = any(reader.state_is_per_process for reader in readers.values())
    if settings.mixture_exhausted == "stop" and per_process and process_count > 1:
        raise ArgumentError(
            "mixture_exhausted='stop' with packing or streaming sources on several processes: "
            "each process reads its own part of such a source and they would run out at "
            "different steps; use mixture_exhausted='restart' (or one process)."
        )
    return MixtureLoader(
        readers,
        MixtureSchedule(names, settings.mixture_stages),
        global_batch_size=settings.global_batch_size,
        accumulation_steps=settings.accumulation_steps,
        process_index=process_index,
        process_count=process_count,
        exhausted=settings.mixture_exhausted,
        read_ahead=read_ahead,
    )


def build_eval_loader(
    settings: DataSettings | Any,
    dataset: Any,
    tokenizer: Any = None,
    collator: Collator | None = None,
    pad_token_id: int | None = 0,
    process_index: int = 0,
    process_count: int = 1,
    featurizer: FeaturizerFactory | None = None,
    vocab_size: int | None = None,
) -> EvalLoader:
    """Every eval row exactly once per evaluation, one document per row."""
    name = "dataset_eval"
    settings = DataSettings.from_arguments(settings)
    if is_hf_dataset(dataset) or isinstance(dataset, ArrowRows):
        scan_tokens(
            RandomAccessSource(dataset, name=name), vocab_size=vocab_size, seq_len=settings.seq_len
        )
    featurizer = _featurizer(settings, tokenizer, name, featurizer, vocab_size)
    return EvalLoader(
        dataset,
        batch_size=settings.eval_batch_size,
        collation=_collation(settings, collator or featurizer.collator, pad_token_id, name),
        featurizer=featurizer,
        process_index=process_index,
        process_count=process_count,
    )

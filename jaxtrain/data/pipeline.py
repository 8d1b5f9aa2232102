"""Build the train and eval loaders of a run from its DataSettings (used by the Trainer;
TrainingArguments are accepted too and read through DataSettings.from_arguments).

Every option is checked here, before anything is compiled. ``process_index`` and
``process_count`` select this host's share of the data (``jax.process_index()`` and
``jax.process_count()`` in a multi-host run); each host's batches are then
``[A, M // process_count, seq_len]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtrain.config.sections import DataSettings
from jaxtrain.data.arrow_rows import ArrowRows
from jaxtrain.data.assemble import Collation, Collator
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.evaluation import EvalLoader
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.loader import BatchLoader, UnitLoader, check_processes, prepare_source
from jaxtrain.data.scan import sample_scan, scan_tokens, warn_truncation
from jaxtrain.data.sources import IterableSource, RandomAccessSource, as_source, is_hf_dataset
from jaxtrain.data.streams import StreamUnits
from jaxtrain.data.units import MapUnits

__all__ = ["build_eval_loader", "build_train_loader"]


# name -> a Featurizer for that dataset, or None for the default one (task trainers' rows).
FeaturizerFactory = Callable[[str], "Featurizer | None"]


def _featurizer(
    settings: DataSettings,
    tokenizer: Any,
    name: str,
    factory: FeaturizerFactory | None = None,
    vocab_size: int | None = None,
) -> Featurizer:
    custom = factory(name) if factory is not None else None
    if custom is not None:
        custom.vocab_size = custom.vocab_size or vocab_size
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
) -> BatchLoader | UnitLoader:
    """A ``BatchLoader`` (random-access data, no packing) or a ``UnitLoader`` (packing or
    streaming). Raises DatasetError/ValueError naming what to fix. `vocab_size`: the
    model's; token ids are checked against it (the whole of a map-style dataset now)."""
    name = "dataset_train"
    settings = DataSettings.from_arguments(settings)
    check_processes(process_index, process_count, settings.micro_batch_size, "micro-batch size")
    source = as_source(dataset, name=name, streaming=settings.streaming)
    featurizer = _featurizer(settings, tokenizer, name, featurizer, vocab_size)
    if isinstance(source, RandomAccessSource):
        scan = scan_tokens(source, vocab_size=vocab_size, seq_len=settings.seq_len)
        if scan is None and collator is None and type(featurizer) is Featurizer:
            # Text or chat rows: tokenize a sample now, so the warning comes at the start.
            scan = sample_scan(source, featurizer, seq_len=settings.seq_len)
        if not (settings.packing and settings.split_long_documents):  # else long rows are split
            warn_truncation(
                scan, name=name, seq_len=settings.seq_len, mode=settings.truncation_mode
            )
    collation = _collation(settings, collator, pad_token_id, name)
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
            collator=collator,
            drop_last=settings.drop_last,
            process_index=process_index,
            process_count=process_count,
            name=name,
            featurizer=featurizer,
        )
    what = "streaming data" if stream else "packing=True"
    if not settings.fixed_length:
        raise DatasetError(
            f"dataset_train with {what} has no known number of steps per epoch; set "
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
    return UnitLoader(
        units,
        collation,
        global_batch_size=settings.global_batch_size,
        accumulation_steps=settings.accumulation_steps,
        packing=settings.packing,
        packing_window=settings.packing_window,
        split_long_documents=settings.split_long_documents,
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
    return EvalLoader(
        dataset,
        batch_size=settings.eval_batch_size,
        collation=_collation(settings, collator, pad_token_id, name),
        featurizer=_featurizer(settings, tokenizer, name, featurizer, vocab_size),
        process_index=process_index,
        process_count=process_count,
    )

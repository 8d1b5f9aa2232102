"""Data pipeline: the embedded demo corpus, collation, train/eval batch loaders, prefetch."""

from jaxtrain.data.collate import IGNORE_INDEX, CollateStats, collate_examples
from jaxtrain.data.corpus import DefaultCorpus, chunk_dataset, load_default_corpus
from jaxtrain.data.loader import (
    BatchLoader,
    DatasetError,
    eval_batches,
    num_eval_batches,
    validate_dataset,
)
from jaxtrain.data.prefetch import Prefetcher, prefetch

__all__ = [
    "IGNORE_INDEX",
    "BatchLoader",
    "CollateStats",
    "DatasetError",
    "DefaultCorpus",
    "Prefetcher",
    "chunk_dataset",
    "collate_examples",
    "eval_batches",
    "load_default_corpus",
    "num_eval_batches",
    "prefetch",
    "validate_dataset",
]

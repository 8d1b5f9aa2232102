"""Data pipeline: sources (HF, files, Grain, TFDS, iterables), featurizing (ids, text, chat),
packing, deterministic resumable per-process loaders, weighted mixtures of sources, exact
eval batches, prefetch, meter."""

from jaxtrain.data.assemble import Collation
from jaxtrain.data.chat import render_chat
from jaxtrain.data.collate import IGNORE_INDEX, CollateStats, collate_examples
from jaxtrain.data.corpus import DefaultCorpus, chunk_dataset, load_default_corpus
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.evaluation import EvalLoader, eval_batches, num_eval_batches
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.files import load_files
from jaxtrain.data.loader import BatchLoader, validate_dataset
from jaxtrain.data.meter import DataMeter
from jaxtrain.data.mixture import MixtureLoader, Source
from jaxtrain.data.packing import pack_row
from jaxtrain.data.pipeline import build_eval_loader, build_mixture_loader, build_train_loader
from jaxtrain.data.prefetch import Prefetcher, prefetch
from jaxtrain.data.sources import IterableSource, RandomAccessSource, as_source
from jaxtrain.data.streams import stream_window
from jaxtrain.data.tfds import tfds_source
from jaxtrain.data.unit_loader import UnitLoader

__all__ = [
    "IGNORE_INDEX",
    "BatchLoader",
    "Collation",
    "CollateStats",
    "DataMeter",
    "DatasetError",
    "DefaultCorpus",
    "EvalLoader",
    "Featurizer",
    "IterableSource",
    "MixtureLoader",
    "Prefetcher",
    "RandomAccessSource",
    "Source",
    "UnitLoader",
    "as_source",
    "build_eval_loader",
    "build_mixture_loader",
    "build_train_loader",
    "chunk_dataset",
    "collate_examples",
    "eval_batches",
    "load_default_corpus",
    "load_files",
    "num_eval_batches",
    "pack_row",
    "prefetch",
    "render_chat",
    "stream_window",
    "tfds_source",
    "validate_dataset",
]

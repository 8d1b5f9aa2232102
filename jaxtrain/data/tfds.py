"""TFDS through its array-record data sources (random access, no TensorFlow graph).

``tensorflow-datasets`` is an optional extra (``pip install jaxtrain[tfds]``); it is imported
only when this function is called. The returned source plugs into ``Trainer`` like any other
random-access dataset.
"""

from __future__ import annotations

from typing import Any

from jaxtrain.data.errors import DatasetError

__all__ = ["tfds_source"]


def tfds_source(name: str, *, split: str = "train", data_dir: str | None = None) -> Any:
    """``tfds.data_source(name, split=..., data_dir=...)``: a random-access source of dicts.

    The dataset must have been prepared in the array_record file format. Text features come
    back as bytes and are decoded as UTF-8 by the featurizer.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as exc:
        raise DatasetError(
            f"TFDS dataset {name!r} needs tensorflow-datasets, which is not installed; "
            "install the optional extra: pip install 'jaxtrain[tfds]' (TensorFlow itself is "
            "not needed for array-record data sources)"
        ) from exc
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir)
    except Exception as exc:
        raise DatasetError(
            f"TFDS dataset {name!r} (split {split!r}, data_dir {data_dir!r}) cannot be opened "
            f"as an array-record data source: {exc}. Prepare it with file_format='array_record'."
        ) from exc

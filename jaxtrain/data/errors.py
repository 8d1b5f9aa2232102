"""The one exception of the data pipeline."""

from __future__ import annotations

__all__ = ["DatasetError"]


class DatasetError(ValueError):
    """A dataset cannot be used as given; the message names the dataset, file/row/column and fix."""

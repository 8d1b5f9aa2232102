"""The one exception of the data pipeline (defined in jaxtrain.errors)."""

from __future__ import annotations

from jaxtrain.errors import DatasetError

__all__ = ["DatasetError"]

"""The one error type of the Hugging Face interop (defined in jaxtrain.errors)."""

from __future__ import annotations

from jaxtrain.errors import HFError

__all__ = ["HFError"]

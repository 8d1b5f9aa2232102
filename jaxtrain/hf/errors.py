"""The one error type of the Hugging Face interop."""

from __future__ import annotations


class HFError(ValueError):
    """A Hugging Face directory, config or weight file jaxtrain cannot load or write.

    The message names the file, the field or tensor, and how to fix it. The CLI turns it
    into exit code 2 (bad input).
    """

"""Prompts with images on the engine (a vision-language model's, e.g. Gemma 3's).

A request's prompt holds each image as a run of the model's image token (the processor
expanded it) and the request carries the images' pixels, [n, C, H, W] in the order of their
runs. What changes for such a prompt:
- its prefill never splits an image's run between two chunks (an image's tokens attend to
  each other both ways, so they are written in one call), and each prefill call takes the
  images whose runs it writes, `max_images` slots per row;
- its pages are neither looked up in nor added to the prefix cache: the cache knows pages by
  their token ids, and every image has the same ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxtrain.errors import ArgumentError

__all__ = ["ImageInputs"]


def _runs(prompt: np.ndarray, token: int) -> list[tuple[int, int]]:
    """(start, end) of every run of `token` in `prompt`."""
    is_image = np.concatenate([[False], prompt == token, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """How an engine's model takes images: its image token, the shape of an image, and the
    image slots of each row of a prefill call (`max_images`)."""

    token_id: int
    shape: tuple[int, ...]
    max_images: int

    @classmethod
    def of(cls, config: Any, max_images: int) -> ImageInputs | None:
        """For a model config with an image token (None for a text model)."""
        token = getattr(config, "image_token_id", None)
        if token is None:
            return None
        if not isinstance(max_images, int) or max_images < 1:
            raise ArgumentError(f"max_images must be a positive integer, got {max_images!r}")
        return cls(int(token), tuple(config.image_shape), max_images)

    def check(self, prompt: np.ndarray, images: Any, prefill_tokens: int) -> np.ndarray | None:
        """The request's images as float32 [n, C, H, W] (None without), or ArgumentError."""
        runs = _runs(prompt, self.token_id)
        if images is None or len(images) == 0:
            if runs:
                raise ArgumentError(
                    f"the prompt holds {len(runs)} image(s) of tokens but the request no pixels"
                )
            return None
        pixels = np.asarray(images, np.float32)
        if pixels.ndim != 4 or pixels.shape[1:] != self.shape or len(pixels) != len(runs):
            raise ArgumentError(
                f"images must be [{len(runs)} (the prompt's image runs), "
                f"{', '.join(map(str, self.shape))}], got {tuple(pixels.shape)}"
            )
        if len(pixels) > self.max_images:
            raise ArgumentError(
                f"the prompt has {len(pixels)} images; this engine takes at most "
                f"max_images={self.max_images} per prompt"
            )
        longest = max(end - start for start, end in runs)
        if longest > prefill_tokens:
            raise ArgumentError(
                f"an image of {longest} tokens does not fit one prefill call of "
                f"prefill_tokens={prefill_tokens}; raise prefill_tokens"
            )
        return pixels

    def cut(self, prompt: np.ndarray, done: int, take: int) -> int:
        """`take` tokens from `done`, shortened to end before an image's run rather than
        inside it (a run starting at `done` fits whole: `check` bounded runs)."""
        end = done + take
        for start, stop in _runs(prompt, self.token_id):
            if start < end < stop and start > done:
                return start - done
        return take

    def chunk(self, rows: list[tuple[Any, int, int]], slots: int) -> np.ndarray:
        """[slots, max_images, C, H, W]: for each (request, done, take) of a prefill call,
        the images whose runs start among the tokens it writes, in order; the rest zero."""
        out = np.zeros((slots, self.max_images, *self.shape), np.float32)
        for row, (request, done, take) in enumerate(rows):
            if request.images is None:
                continue
            runs = _runs(request.prompt, self.token_id)
            mine = [i for i, (start, _) in enumerate(runs) if done <= start < done + take]
            out[row, : len(mine)] = request.images[mine]
        return out

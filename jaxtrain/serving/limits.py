"""What one `jaxtrain serve` request may ask for, and how much the server takes at once.

Each limit bounds a cost a client could otherwise push onto everyone else: the body's bytes
(parsed and tokenized before anything else looks at it), the prompt's tokens (prefill time
and KV pages), `max_tokens` (decode time and pages held), `n` (slots), the stop strings
(every stop string is searched in a sample's text at every token), the queue (memory and
everyone's wait) and a request's wall time. A request past a limit gets a 4xx in OpenAI's
error shape (openai_api.RequestError); `docs/serving.md` lists which answers what.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ServeLimits"]


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """The server's limits. `None` where the engine's own bound is the sensible default:
    `max_prompt_tokens` and `max_tokens` default to the context (`max_length`), `max_n` to
    the engine's slots (more samples than slots can never run)."""

    max_body_bytes: int = 4 * 1024 * 1024  # 413; a 100k-token chat is well under 1 MiB
    max_prompt_tokens: int | None = None  # 400
    max_tokens: int | None = None  # 400
    max_n: int | None = None  # 400
    max_stop: int = 4  # 400; OpenAI's own API takes up to 4 stop sequences
    max_stop_length: int = 128  # 400; characters of one stop string
    max_queue: int = 128  # 429 once this many requests wait for a slot
    request_timeout: float = 600.0  # seconds from arrival to the last token; 0: none
    retry_after: int = 1  # seconds, the 429's Retry-After hint

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_stop_length", "retry_after"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens", "max_n"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("max_stop", "max_queue", "request_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def for_engine(self, max_length: int, max_slots: int) -> ServeLimits:
        """These limits with the engine's bounds filled in where none was given."""
        return dataclasses.replace(
            self,
            max_prompt_tokens=self.max_prompt_tokens or max_length - 1,
            max_tokens=self.max_tokens or max_length - 1,
            max_n=self.max_n or max_slots,
        )

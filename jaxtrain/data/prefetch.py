"""Background prefetch: run an iterator in a daemon thread behind a bounded queue.

Producer exceptions are re-raised in the consumer, never swallowed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_ITEM, _END, _ERROR = "item", "end", "error"


class Prefetcher(Generic[T]):
    """Iterator that fills a bounded queue from a background daemon thread.

    A producer exception is re-raised in the consumer (once, then the iterator is finished);
    ``close()`` stops the thread. Usable as a context manager.
    """

    def __init__(self, iterable: Iterable[T], size: int = 2) -> None:
        if size <= 0:
            raise ValueError(f"prefetch size must be positive, got {size}")
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(
            target=self._produce, args=(iter(iterable),), name="jaxtrain-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, message: tuple[str, Any]) -> bool:
        # Poll so a closed prefetcher never leaves the producer blocked on a full queue.
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, iterator: Iterator[T]) -> None:
        try:
            for item in iterator:
                if not self._put((_ITEM, item)):
                    return
            self._put((_END, None))
        except BaseException as exc:  # forwarded to the consumer, never swallowed
            self._put((_ERROR, exc))
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        kind, payload = self._queue.get()
        if kind == _ITEM:
            return payload
        self._finished = True
        if kind == _ERROR:
            raise payload
        raise StopIteration

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the producer thread and drop queued items."""
        self._finished = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def prefetch(iterable: Iterable[T], size: int = 2) -> Prefetcher[T]:
    """Run ``iterable`` ahead in a background thread, keeping at most ``size`` items ready."""
    return Prefetcher(iterable, size)

"""The engine on a thread of its own, fed by other threads (the HTTP server's event loop).

The engine is single-threaded: every call to it happens on this thread. Other threads send
commands through a queue (`submit`, `cancel`); each request's events (its tokens, its end,
an error) go to a sink the caller gives, called on this thread (the server hands them to its
event loop with `call_soon_threadsafe`). The thread steps the engine while it has work and
sleeps on the queue when it has none.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from jaxtrain.errors import JaxtrainError
from jaxtrain.serving.engine import Completion, Engine
from jaxtrain.serving.metrics import EngineStats
from jaxtrain.serving.sampling import SamplingParams

__all__ = ["EngineRunner", "Event", "QueueFull"]

logger = logging.getLogger("jaxtrain.serving")


@dataclasses.dataclass
class Event:
    """What a request's sink receives: a token of sample `index`, a finished sample
    (`completion`), or the error that ended the request."""

    kind: str  # "token", "done" or "error"
    index: int = 0
    token: int | None = None
    logprob: float | None = None  # the token's log-prob under the model
    top_logprobs: dict[int, float] | None = None  # with SamplingParams.logprobs = k > 0
    completion: Completion | None = None
    error: BaseException | None = None


Sink = Callable[[Event], None]


class QueueFull(JaxtrainError):
    """The engine's queue holds `max_queue` requests already (the server answers 429)."""


class EngineRunner:
    """See the module docstring."""

    def __init__(self, engine: Engine, *, max_queue: int | None = None):
        self.engine = engine
        self.max_queue = max_queue  # None: no limit
        # What the engine's gauges read (/metrics): replaced whole after each step, so a
        # reader on another thread sees one consistent snapshot without a lock.
        self.stats = EngineStats()
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[int, Sink] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="jaxtrain-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        n: int,
        sink: Sink,
        images: Any = None,
        adapter: int = 0,
    ) -> concurrent.futures.Future:
        """Queue a request (`images`: a vision prompt's pixels; `adapter`: its LoRA adapter);
        the future gives its id (or the engine's refusal)."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("submit", (list(prompt), params, n, sink, images, adapter), reply))
        return reply

    def cancel(self, request_id: int) -> None:
        """Drop a request (a client that went away): its slots and pages are freed."""
        self._commands.put(("cancel", request_id, None))

    @property
    def alive(self) -> bool:
        """The engine's thread runs (it ends only with `close`)."""
        return self._thread.is_alive()

    def close(self) -> None:
        self._stopped = True
        self._commands.put(("stop", None, None))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stopped:
            self._publish()  # before the queue may block: the gauges show the engine idle
            block = self.engine.idle
            try:
                while True:
                    command = self._commands.get(block=block)
                    block = False
                    self._handle(*command)
            except queue.Empty:
                pass
            self._publish()  # what the commands changed (a new request waits)
            if self._stopped or self.engine.idle:
                continue
            try:
                finished = self.engine.step()
            except JaxtrainError as err:  # the next request cannot run: end it, keep serving
                self._fail_waiting(err)
                continue
            except Exception as err:  # a bug: every request ends with it, the server stays up
                logger.exception("the engine failed; ending every request")
                self._fail_all(err)
                continue
            for completion in finished:
                sink = self._sinks.get(completion.request_id)
                if sink is not None:
                    sink(Event("done", completion.index, completion=completion))

    def _handle(self, kind: str, payload: Any, reply: Any) -> None:
        if kind == "submit":
            prompt, params, n, sink, images, adapter = payload
            if self.max_queue is not None and self._queued() >= self.max_queue:
                reply.set_exception(QueueFull(f"{self.max_queue} requests wait already"))
                return
            try:
                request_id = self.engine.submit(
                    prompt, params, n=n, on_token=self._on_token, images=images, adapter=adapter
                )
            except Exception as err:  # refused (too long, bad n): the caller answers 400
                reply.set_exception(err)
                return
            self._sinks[request_id] = sink
            reply.set_result(request_id)
        elif kind == "cancel":
            self.engine.cancel(payload)
            self._sinks.pop(payload, None)

    def _queued(self) -> int:
        """Requests that will still wait after the next step admits what the free slots
        take (first come, first served: admission stops at the first that does not fit).
        Counting the whole queue instead would refuse a burst that free slots can take."""
        free = self.engine.max_slots - self.engine.slots_in_use
        for position, request in enumerate(self.engine.waiting):
            if request.n > free:
                return len(self.engine.waiting) - position
            free -= request.n
        return 0

    def _publish(self) -> None:
        pages = self.engine.pages
        total = pages.num_pages - 1  # page 0 is never handed out
        self.stats = EngineStats(
            waiting=len(self.engine.waiting),
            running=self.engine.slots_in_use,  # decoding, and prefilling (their slots held)
            pages_used=total - pages.available,
            pages_total=total,
            preemptions=self.engine.preemptions,
        )

    def _on_token(
        self, request_id: int, index: int, token: int, logprob: float, top: dict | None
    ) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink(Event("token", index, token=token, logprob=logprob, top_logprobs=top))

    def _fail_waiting(self, err: Exception) -> None:
        """The engine refused its next waiting request (it cannot fit even alone)."""
        request = self.engine.waiting.popleft()
        logger.warning("request %d failed: %s", request.request_id, err)
        sink = self._sinks.pop(request.request_id, None)
        if sink is not None:
            sink(Event("error", error=err))

    def _fail_all(self, err: Exception) -> None:
        for request_id in {s.request_id for s in self.engine.active} | {
            r.request_id for r in self.engine.waiting
        }:
            self.engine.cancel(request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(Event("error", error=err))

    def forget(self, request_id: int) -> None:
        """The request's sink is no longer needed (all its samples are done)."""
        self._commands.put(("cancel", request_id, None))

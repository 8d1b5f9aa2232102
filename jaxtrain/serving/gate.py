"""The door every HTTP request of `jaxtrain serve` passes: the API key, the drain, the body's
declared size, and the count of responses by status.

A plain ASGI middleware rather than FastAPI dependencies: it sees every path (an unknown
route too, so a client without the key cannot even probe which routes exist), it answers
before the body is read, and it wraps a streaming response whole, so `in_flight` counts a
stream until its last byte is sent (the drain waits for exactly that). GET /health passes
without a key: load balancers and orchestrators probe it without credentials. A request the
server fails on (a bug) is logged with its traceback and answered 500 in OpenAI's error shape,
counted like any other answer, instead of Starlette's plain-text page.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from jaxtrain.serving.metrics import Metrics
from jaxtrain.serving.openai_api import RequestError, error_body

__all__ = ["Gate", "GateState", "send_error"]

logger = logging.getLogger("jaxtrain.serving")

OPEN_PATHS = ("/health",)  # no key, not counted, answered while draining (with 503)
UNCOUNTED_PATHS = ("/health", "/metrics")  # a scrape is not traffic

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclasses.dataclass
class GateState:
    """Shared by the gate, the routes and the signal handler (all on the event loop)."""

    draining: bool = False  # after SIGTERM: new requests get 503, running ones finish
    in_flight: int = 0  # requests past the gate whose response is not fully sent


async def send_error(
    send: Send, err: RequestError, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps(error_body(err)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": err.status, "headers": head + (headers or [])}
    )
    await send({"type": "http.response.body", "body": body})


class Gate:
    """See the module docstring. `api_key` None: no key asked (loopback, or the user said
    so); `max_body_bytes`: a larger Content-Length is refused at once (413)."""

    def __init__(
        self,
        app: Any,
        *,
        state: GateState,
        metrics: Metrics,
        api_key: str | None,
        max_body_bytes: int,
    ):
        self.app, self.state, self.metrics = app, state, metrics
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return

        started = False

        async def counted(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if path not in UNCOUNTED_PATHS:
                    self.metrics.count_response(message["status"])
            await send(message)

        headers = dict(scope["headers"])
        if self.key is not None and not self._authorized(headers.get(b"authorization", b"")):
            err = RequestError(401, "a valid API key is needed: 'Authorization: Bearer KEY'")
            await send_error(counted, err, [(b"www-authenticate", b"Bearer")])
            return
        if self.state.draining and path not in UNCOUNTED_PATHS:  # a scrape sees the drain
            err = RequestError(503, "the server is shutting down; retry on another replica")
            await send_error(counted, err, [(b"connection", b"close")])
            return
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            err = RequestError(
                413, f"the request body is over this server's {self.max_body_bytes} bytes"
            )
            await send_error(counted, err, [(b"connection", b"close")])
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, counted)
        except Exception:
            logger.exception("%s %s failed", scope.get("method", ""), path)
            if started:  # its status went out: the connection's end is all that is left
                raise
            err = RequestError(
                500, "the server failed on this request (its log has the traceback); please "
                "report it", code="internal_error",
            )  # fmt: skip
            await send_error(counted, err)
        finally:
            self.state.in_flight -= 1

    def _authorized(self, header: bytes) -> bool:
        scheme, _, given = header.partition(b" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)

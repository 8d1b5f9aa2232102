"""`jaxtrain serve`'s process: uvicorn with a drain on SIGTERM (and SIGINT).

On the first signal the server keeps its socket open but answers every new request 503 (the
gate), so a load balancer's retry goes to another replica instead of meeting a refused
connection; the requests already in flight (waiting, decoding, streaming) run to their end;
then uvicorn shuts down and the process exits 0. The drain lasts at most the longest request,
which `--request_timeout` bounds. A second signal ends the process at once (128 + signal).

uvicorn's own handling does not fit: it stops accepting at once, and after its shutdown it
raises the signal again with the default handler, so a drained server would still exit -15.
Its `capture_signals` is the one method overridden here.

An idle keep-alive connection stays open `KEEP_ALIVE_S`, longer than clients keep one in their
pool (httpx's, which the `openai` client uses: 5 s). At uvicorn's own 5 s the two timers race: a
client could send on a connection in the instant the server closes it, and get no response.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from jaxtrain import interrupts
from jaxtrain.serving.gate import GateState

__all__ = ["serve_until_drained"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)
KEEP_ALIVE_S = 75.0  # nginx's default; above every common client pool's idle expiry


def serve_until_drained(app: Any, listener: socket.socket, log_level: str = "warning") -> None:
    """Run `app` (server.create_app's) on the bound socket `listener` until a signal, then
    drain it (module docstring)."""
    import uvicorn

    gate: GateState = app.state.gate

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach the main thread only; nothing to install
                return
            loop = asyncio.get_running_loop()
            tasks: list[asyncio.Task] = []

            async def drain() -> None:
                while gate.in_flight:
                    await asyncio.sleep(0.05)
                self.should_exit = True

            def on_signal(number: int, frame: Any) -> None:
                name = signal.Signals(number).name
                if gate.draining:
                    why = f"{name} again: stopped without draining"
                    interrupts.abort("jaxtrain serve", why, number)
                gate.draining = True
                print(f"jaxtrain serve: {name}: finishing the requests in flight", flush=True)
                # The loop holds only a weak reference to a task: keep this one.
                loop.call_soon_threadsafe(lambda: tasks.append(loop.create_task(drain())))

            previous = {number: signal.signal(number, on_signal) for number in SIGNALS}
            try:
                yield
            finally:
                for number, handler in previous.items():
                    signal.signal(number, handler)

    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S)
    DrainingServer(config).run(sockets=[listener])

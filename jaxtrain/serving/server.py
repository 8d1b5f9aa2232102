"""`jaxtrain serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra) on
the generation engine.

Routes: GET /v1/models, POST /v1/completions and /v1/chat/completions (the chat template
applied), each streaming (server-sent events) or not, with `n` samples and usage counts.
Concurrent requests are batched by the engine (runner.py: the engine on its own thread). A bad
request gets a 4xx JSON error in OpenAI's shape and the server keeps serving; a client that
disconnects mid-stream has its request cancelled, which frees its slot and pages.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request)
# at run time, and Request is imported inside create_app (fastapi is an extra).
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from jaxtrain.serving.engine import Engine
from jaxtrain.serving.openai_api import (
    RequestError,
    chunk,
    error_body,
    new_id,
    parse_request,
    response,
    usage,
)
from jaxtrain.serving.runner import EngineRunner, Event

__all__ = ["create_app"]


def create_app(engine: Engine, *, model_name: str, tokenizer: Any) -> Any:
    """The FastAPI app serving `engine` under `model_name`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    runner = EngineRunner(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        runner.close()  # the engine's thread ends with the server

    app = FastAPI(title="jaxtrain serve", lifespan=lifespan)
    created = int(time.time())

    def refuse(err: RequestError) -> JSONResponse:
        return JSONResponse(error_body(err), status_code=err.status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "jaxtrain"}
        return {"object": "list", "data": [card]}

    async def complete(request: Request, chat: bool) -> Any:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as err:
            return refuse(RequestError(400, f"the request body is not valid JSON: {err}"))
        try:
            parsed = parse_request(
                body,
                chat=chat,
                model_name=model_name,
                tokenizer=tokenizer,
                max_length=engine.max_length,
            )
        except RequestError as err:
            return refuse(err)
        except ValueError as err:  # SamplingParams' own checks
            return refuse(RequestError(400, str(err)))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # called on the engine's thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        future = runner.submit(parsed.prompt_ids, parsed.params, parsed.n, sink)
        try:
            request_id = await asyncio.wrap_future(future)
        except ValueError as err:  # the engine refused it (n above its slots, too long)
            return refuse(RequestError(400, str(err)))
        if parsed.stream:
            stream = _stream(parsed, model_name, tokenizer, events, runner, request_id)
            return StreamingResponse(stream, media_type="text/event-stream")
        try:
            done = await _collect(events, parsed.n)
        except RequestError as err:
            return refuse(err)
        finally:
            runner.forget(request_id)
        return response(
            parsed,
            model_name,
            [c.text or "" for c in done],
            [c.finish_reason for c in done],
            [len(c.token_ids) for c in done],
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    app.state.runner = runner
    return app


async def _collect(events: asyncio.Queue, n: int) -> list[Any]:
    done: dict[int, Any] = {}
    while len(done) < n:
        event = await events.get()
        if event.kind == "error":
            raise RequestError(400, str(event.error))
        if event.kind == "done":
            done[event.index] = event.completion
    return [done[i] for i in range(n)]


async def _stream(parsed, model_name, tokenizer, events, runner, request_id) -> AsyncIterator[str]:
    """Server-sent events: each sample's new text as it decodes, its end, usage, [DONE]. Text
    that could still become the start of a stop string is held back until it cannot."""
    stream_id = new_id(parsed.chat)
    hold = max((len(s) for s in parsed.params.stop), default=1) - 1
    ids: dict[int, list[int]] = {i: [] for i in range(parsed.n)}
    sent = dict.fromkeys(range(parsed.n), 0)
    finished: dict[int, int] = {}

    def event(index: int, text: str | None, reason: str | None, first: bool = False) -> str:
        body = chunk(parsed, model_name, stream_id, index, text, reason, first=first)
        return f"data: {json.dumps(body)}\n\n"

    try:
        if parsed.chat:
            for i in range(parsed.n):
                yield event(i, None, None, first=True)
        while len(finished) < parsed.n:
            item = await events.get()
            if item.kind == "error":
                error = error_body(RequestError(400, str(item.error)))
                yield f"data: {json.dumps(error)}\n\n"
                return
            i = item.index
            if item.kind == "token":
                ids[i].append(item.token)
                text = tokenizer.decode(ids[i], skip_special_tokens=True)
                safe = len(text) - hold if parsed.params.stop else len(text)
                if text.endswith("\ufffd"):  # half of a multi-byte character
                    safe = min(safe, len(text) - 1)
                if safe > sent[i]:
                    yield event(i, text[sent[i] : safe], None)
                    sent[i] = safe
            else:
                completion = item.completion
                final = completion.text or ""
                rest = final[sent[i] :] if len(final) > sent[i] else ""
                yield event(i, rest or None, completion.finish_reason)
                finished[i] = len(completion.token_ids)
        if parsed.include_usage:
            tail = chunk(parsed, model_name, stream_id, 0, None, None)
            tail["choices"] = []
            tail["usage"] = usage(len(parsed.prompt_ids), sum(finished.values()))
            yield f"data: {json.dumps(tail)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # done, or the client went away: free the request's slots and pages
        runner.cancel(request_id)

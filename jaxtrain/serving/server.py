"""`jaxtrain serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra) on
the generation engine.

Routes: GET /v1/models, POST /v1/completions and /v1/chat/completions (the chat template
applied), each streaming (server-sent events) or not, with `n` samples and usage counts;
GET /health and GET /metrics (Prometheus). Concurrent requests are batched by the engine
(runner.py: the engine on its own thread). Every request passes the gate first (gate.py: the
API key, the drain, the body's size); each limit (limits.py) has its 4xx in OpenAI's error
shape and the server keeps serving; a client that disconnects mid-stream, or a request past
the timeout, has its request cancelled, which frees its slots and pages.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request)
# at run time, and Request is imported inside create_app (fastapi is an extra).
import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxtrain.data.vision import text_tokenizer
from jaxtrain.serving.engine import Engine
from jaxtrain.serving.gate import Gate, GateState
from jaxtrain.serving.limits import ServeLimits
from jaxtrain.serving.metrics import CONTENT_TYPE, Metrics, RequestClock
from jaxtrain.serving.openai_api import (
    RequestError,
    chunk,
    error_body,
    logprobs_field,
    new_id,
    parse_request,
    response,
    usage,
)
from jaxtrain.serving.runner import EngineRunner, Event, QueueFull
from jaxtrain.serving.tool_api import tool_message

__all__ = ["create_app"]

# A request past its timeout is answered 504 Gateway Timeout, not 408 Request Timeout: 408
# says the *client* was too slow to send its request, which is not what happened; 504 says
# the server's upstream (here the engine) did not answer in time, and clients and proxies
# treat it as a server-side condition they may retry (the openai client retries it).
TIMEOUT_STATUS = 504


def create_app(
    engine: Engine,
    *,
    model_name: str,
    tokenizer: Any,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    adapters: Sequence[str] = (),
) -> Any:
    """The FastAPI app serving `engine` under `model_name` (and its LoRA `adapters`, loaded on
    the engine's model by serving/adapters.py, under theirs: a request's `model` picks). `api_key`: every request but
    GET /health needs `Authorization: Bearer api_key` (None: none asked; cli/serve.py refuses
    that off loopback). `limits`: see limits.py (default: its defaults)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    limits = (limits or ServeLimits()).for_engine(engine.max_length, engine.max_slots)
    runner = EngineRunner(engine, max_queue=limits.max_queue)
    # A vision-language model's processor renders chats with images; the rest reads text.
    processor, tokenizer = tokenizer, text_tokenizer(tokenizer)
    vocab_size = _vocab_size(engine, tokenizer)
    metrics, gate = Metrics(), GateState()
    # Requests are read and tokenized on a thread of their own: a prompt of megabytes takes
    # seconds to tokenize, which on the event loop would stall every stream and /health.
    # One thread, so two requests never use the tokenizer at once (as on the loop).
    parsing = ThreadPoolExecutor(1, thread_name_prefix="jaxtrain-parse")

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        yield
        parsing.shutdown(wait=False, cancel_futures=True)
        runner.close()  # the engine's thread ends with the server

    app = FastAPI(title="jaxtrain serve", lifespan=lifespan)
    app.add_middleware(
        Gate, state=gate, metrics=metrics, api_key=api_key, max_body_bytes=limits.max_body_bytes
    )
    created = int(time.time())

    def refuse(err: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def unknown_route(request: Request, exc: HTTPException) -> Any:
        """An unknown path or method answers in OpenAI's error shape too."""
        where = f"{request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "")
        return refuse(RequestError(exc.status_code, f"{where}: {exc.detail}", code=code),
                      exc.headers)  # fmt: skip

    @app.get("/health")
    async def health() -> Any:
        if not runner.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Any:
        text = metrics.render(runner.stats, in_flight=gate.in_flight, engine_alive=runner.alive)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "jaxtrain"}
    cards = [card] + [{**card, "id": name, "parent": model_name} for name in adapters]

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> Any:  # the openai client's models.retrieve
        found = [c for c in cards if c["id"] == model_id]
        if found:
            return found[0]
        served = ", ".join(repr(c["id"]) for c in cards)
        return refuse(RequestError(404, f"the model {model_id!r} does not exist; this server "
                                   f"serves {served}", "model", "model_not_found"))  # fmt: skip

    async def complete(request: Request, chat: bool) -> Any:
        arrival = time.monotonic()
        deadline = arrival + limits.request_timeout if limits.request_timeout else None
        try:
            body = json.loads(await _read_body(request, limits.max_body_bytes))
        except RequestError as err:
            return refuse(err)
        except (ValueError, UnicodeDecodeError) as err:
            return refuse(RequestError(400, f"the request body is not valid JSON: {err}"))
        except RecursionError:
            return refuse(RequestError(400, "the request body is nested too deeply"))
        loop = asyncio.get_running_loop()
        parse = functools.partial(
            parse_request,
            body,
            chat=chat,
            model_name=model_name,
            tokenizer=processor,
            max_length=engine.max_length,
            limits=limits,
            vocab_size=vocab_size,
            adapters=adapters,
        )
        try:
            parsed = await loop.run_in_executor(parsing, parse)
        except RequestError as err:
            return refuse(err)
        except ValueError as err:  # SamplingParams' own checks
            return refuse(RequestError(400, str(err)))
        events: asyncio.Queue[Event] = asyncio.Queue()
        clock = RequestClock(metrics, arrival)

        def sink(event: Event) -> None:  # called on the engine's thread
            if event.kind == "token":
                clock.token(event.index, time.monotonic())
            loop.call_soon_threadsafe(events.put_nowait, event)

        future = runner.submit(
            parsed.prompt_ids, parsed.params, parsed.n, sink, parsed.images, parsed.adapter
        )
        try:
            request_id = await asyncio.wrap_future(future)
        except ValueError as err:  # the engine refused it (n above its slots, too long)
            return refuse(RequestError(400, str(err)))
        except QueueFull as err:
            retry = {"Retry-After": str(limits.retry_after)}
            return refuse(RequestError(429, f"the server is busy ({err}); retry later"), retry)
        if parsed.stream:
            stream = _stream(parsed, parsed.model, tokenizer, events, runner, request_id)
            timed = _until(stream, deadline, limits.request_timeout, metrics)
            return StreamingResponse(timed, media_type="text/event-stream")
        try:
            done = await asyncio.wait_for(_collect(events, parsed.n), _left(deadline))
        except asyncio.TimeoutError:
            metrics.count_timeout()
            return refuse(_timeout(limits.request_timeout))
        except RequestError as err:
            return refuse(err)
        finally:
            runner.forget(request_id)  # also cancels it in the engine if it still runs
        return response(parsed, parsed.model, done, tokenizer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    app.state.runner, app.state.gate, app.state.metrics = runner, gate, metrics
    app.state.limits = limits
    return app


def _vocab_size(engine: Engine, tokenizer: Any) -> int | None:
    """The rows of the model's embedding (its config's vocab_size), else the tokenizer's."""
    from flax import nnx

    config = getattr(nnx.merge(engine.graphdef, engine.state), "config", None)
    size = getattr(config, "vocab_size", None)
    if size is None and tokenizer is not None:
        size = len(tokenizer)
    return None if size is None else int(size)


async def _read_body(request: Any, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes `limit` bytes: a body sent without a
    Content-Length (chunked) is not held whole before it is refused."""
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise RequestError(413, f"the request body is over this server's {limit} bytes")
    return bytes(data)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _timeout(seconds: float) -> RequestError:
    return RequestError(
        TIMEOUT_STATUS, f"the request ran past this server's timeout of {seconds:g} s"
    )


async def _collect(events: asyncio.Queue, n: int) -> list[Any]:
    done: dict[int, Any] = {}
    while len(done) < n:
        event = await events.get()
        if event.kind == "error":
            raise RequestError(400, str(event.error))
        if event.kind == "done":
            done[event.index] = event.completion
    return [done[i] for i in range(n)]


async def _until(
    stream: AsyncIterator[str], deadline: float | None, seconds: float, metrics: Metrics
) -> AsyncIterator[str]:
    """The stream's events until `deadline`; past it, an error event ends the stream (its
    status line, 200, went out with the first event) and closing the stream cancels the
    request in the engine."""
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(stream), _left(deadline))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                metrics.count_timeout()
                yield f"data: {json.dumps(error_body(_timeout(seconds)))}\n\n"
                return
            yield item
    finally:
        await stream.aclose()  # its `finally` frees the request's slots and pages


def _sendable(text: str, stop: Sequence[str]) -> int:
    """How much of a sample's decoded `text` a stream may send now: it ends before the first
    stop string in it, before an end of it that could still grow into one, and before half
    of a multi-byte character (U+FFFD until its next token)."""
    end = len(text) - text.endswith("\ufffd")
    for s in stop:
        found = text.find(s)
        if found >= 0:
            end = min(end, found)
            continue
        for k in range(min(len(s) - 1, len(text)), 0, -1):  # the longest end that starts `s`
            if s.startswith(text[-k:]):
                end = min(end, len(text) - k)
                break
    return end


async def _stream(parsed, model_name, tokenizer, events, runner, request_id) -> AsyncIterator[str]:
    """Server-sent events: each sample's new text as it decodes, its end, usage, [DONE]. No
    stop string is sent, nor what follows it (`_sendable`): the events join to the text a
    request without `stream` gets."""
    stream_id = new_id(parsed.chat)
    ids: dict[int, list[int]] = {i: [] for i in range(parsed.n)}
    lps: dict[int, list[float]] = {i: [] for i in range(parsed.n)}  # each token's log-prob
    tops: dict[int, list[dict]] = {i: [] for i in range(parsed.n)}  # and its alternatives
    sent = dict.fromkeys(range(parsed.n), 0)  # characters of each sample's text sent
    sent_ids = dict.fromkeys(range(parsed.n), 0)  # and token ids (return_token_ids)
    offsets = dict.fromkeys(range(parsed.n), 0)  # text_offset of each sample's next token
    finished: dict[int, int] = {}

    def event(index: int, text: str | None, reason: str | None, first: bool = False,
              tool_calls: list | None = None) -> str:  # fmt: skip
        new = slice(sent_ids[index], len(ids[index]))  # the tokens this event carries
        sent_ids[index] = len(ids[index])
        logprobs = None
        if not first:  # log-probs of the event's tokens, offset by the tokens' before them
            top = tops[index][new] if parsed.params.logprobs else None
            logprobs = logprobs_field(
                parsed, tokenizer, ids[index][new], lps[index][new], top, offsets[index]
            )
            if logprobs is not None and not parsed.chat:  # offsets count each token's text
                offsets[index] += sum(len(token) for token in logprobs["tokens"])
        body = chunk(
            parsed, model_name, stream_id, index, text, reason, first=first,
            token_ids=ids[index][new], logprobs=logprobs, tool_calls=tool_calls,
        )  # fmt: skip
        return f"data: {json.dumps(body)}\n\n"

    try:
        if parsed.chat or parsed.return_token_ids:  # the role; the prompt's ids
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
                lps[i].append(item.logprob)
                tops[i].append(item.top_logprobs or {})
                if parsed.tools is not None:  # a call is read whole: the text waits for the end
                    continue
                text = tokenizer.decode(ids[i], skip_special_tokens=True)
                safe = _sendable(text, parsed.params.stop)
                if safe > sent[i]:
                    yield event(i, text[sent[i] : safe], None)
                    sent[i] = safe
            else:
                completion = item.completion
                ids[i] = list(completion.token_ids)  # the engine's own record of the sample
                lps[i] = list(completion.logprobs)
                tops[i] = list(completion.top_logprobs or [{}] * len(ids[i]))
                final = completion.text or ""
                rest = final[sent[i] :] if len(final) > sent[i] else ""
                if parsed.tools is not None:
                    message, called = tool_message(parsed.tools, tokenizer, ids[i],
                                                   parsed.prompt_ids)  # fmt: skip
                    reason = "tool_calls" if called else completion.finish_reason
                    yield event(i, message["content"], reason, tool_calls=message.get("tool_calls"))
                else:
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

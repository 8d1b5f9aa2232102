"""The gate's answer to a request the server fails on: a route that raises (a bug) once got
Starlette's plain-text "Internal Server Error", which OpenAI clients cannot read and which
/metrics never counted. The gate is tested where the server puts it (a middleware of a real
Starlette app, inside Starlette's own error middleware), in front of routes that raise."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")

from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from jaxtrain.serving.gate import Gate, GateState  # noqa: E402
from jaxtrain.serving.metrics import EngineStats, Metrics  # noqa: E402


async def fails(request):
    raise RuntimeError("a bug in a route")


async def fails_mid_stream(request):
    async def body():
        yield "data: one\n\n"
        raise RuntimeError("a bug after the status went out")

    return StreamingResponse(body(), media_type="text/event-stream")


def gated() -> tuple[TestClient, GateState, Metrics]:
    state, metrics = GateState(), Metrics()
    gate = Middleware(Gate, state=state, metrics=metrics, api_key=None, max_body_bytes=1024)
    app = Starlette(routes=[Route("/v1/fails", fails, methods=["POST"]),
                            Route("/v1/stream", fails_mid_stream, methods=["POST"])],
                    middleware=[gate])  # fmt: skip
    return TestClient(app, raise_server_exceptions=False), state, metrics


def test_a_failing_route_answers_500_in_openai_s_shape_counted_and_logged(caplog):
    client, state, metrics = gated()
    with caplog.at_level(logging.ERROR, logger="jaxtrain.serving"):
        answer = client.post("/v1/fails", json={})
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "a bug in a route" in caplog.text  # the traceback is in the log, not lost
    text = metrics.render(EngineStats(), in_flight=state.in_flight, engine_alive=True)
    assert 'jaxtrain_requests_total{status="500"} 1' in text
    assert state.in_flight == 0


def test_a_stream_that_fails_after_its_status_ends_without_a_second_answer(caplog):
    client, state, _ = gated()
    with (
        caplog.at_level(logging.ERROR, logger="jaxtrain.serving"),
        client.stream("POST", "/v1/stream", json={}) as stream,
    ):
        assert stream.status_code == 200
        assert next(stream.iter_lines()) == "data: one"
    assert "after the status went out" in caplog.text and state.in_flight == 0

"""`GET /metrics`: the server's counters and the engine's gauges in Prometheus' text format.

Written here rather than with prometheus_client: a few dozen lines of the exposition format
(version 0.0.4) cost less than a dependency of the `serve` extra. Two threads report: the
engine's thread (every token, through the request's sink) and the event loop (each response's
status), so every update takes one lock. The engine's gauges come from the `EngineStats` the
engine's thread publishes after each step (runner.py); nothing here touches the engine.

Tokens per second is `rate(jaxtrain_generated_tokens_total[1m])`: a counter, not a gauge
averaged over a window chosen here.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from collections.abc import Sequence

__all__ = ["CONTENT_TYPE", "EngineStats", "Histogram", "Metrics", "RequestClock"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds. The first token pays the queue and the prefill (a long prompt: seconds); a token
# after it pays one decode step (milliseconds on an accelerator, tens on a CPU).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine as its thread last saw it (after a step, or after taking commands)."""

    waiting: int = 0  # requests in the engine's queue, not yet admitted
    running: int = 0  # sequences decoding (a request of n samples runs n)
    pages_used: int = 0  # KV pages held by running sequences (cached prefixes not counted)
    pages_total: int = 0  # pages that can be handed out (the reserved page 0 not counted)
    preemptions: int = 0  # sequences preempted so far (the pool ran out; recomputed later)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus reads them."""

    def __init__(self, buckets: Sequence[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """The server's counters and histograms (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: collections.Counter[int] = collections.Counter()
        self.generated_tokens = 0
        self.timeouts = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def count_response(self, status: int) -> None:
        with self._lock:
            self.requests[status] += 1

    def count_timeout(self) -> None:
        with self._lock:
            self.timeouts += 1

    def token(self, first_after: float | None, since_previous: float | None) -> None:
        """One generated token: the request's first (seconds since it arrived), or a
        sample's next (seconds since that sample's previous token)."""
        with self._lock:
            self.generated_tokens += 1
            if first_after is not None:
                self.ttft.observe(first_after)
            if since_previous is not None:
                self.itl.observe(since_previous)

    def render(self, stats: EngineStats, *, in_flight: int, engine_alive: bool) -> str:
        """The exposition text: one HELP, one TYPE and the samples of each metric."""
        out: list[str] = []

        def family(name: str, kind: str, doc: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples])

        def gauge(name: str, doc: str, value: float) -> None:
            family(name, "gauge", doc, [f"{name} {value}"])

        gauge("jaxtrain_queue_depth", "Requests waiting for a slot.", stats.waiting)
        gauge("jaxtrain_running_sequences", "Sequences decoding now.", stats.running)
        gauge("jaxtrain_kv_pages_used", "KV cache pages held by sequences.", stats.pages_used)
        gauge("jaxtrain_kv_pages_total", "KV cache pages in the pool.", stats.pages_total)
        gauge("jaxtrain_http_requests_in_flight", "HTTP requests being answered.", in_flight)
        gauge("jaxtrain_engine_alive", "1 while the engine's thread runs.", int(engine_alive))
        with self._lock:
            family(
                "jaxtrain_generated_tokens_total",
                "counter",
                "Tokens generated (rate() of it: tokens per second).",
                [f"jaxtrain_generated_tokens_total {self.generated_tokens}"],
            )
            family(
                "jaxtrain_requests_total",
                "counter",
                "HTTP responses by status code (/health and /metrics not counted).",
                [
                    f'jaxtrain_requests_total{{status="{status}"}} {count}'
                    for status, count in sorted(self.requests.items())
                ],
            )
            family(
                "jaxtrain_preemptions_total",
                "counter",
                "Sequences preempted when the KV pool ran out (their pages freed, recomputed "
                "later).",
                [f"jaxtrain_preemptions_total {stats.preemptions}"],
            )
            family(
                "jaxtrain_request_timeouts_total",
                "counter",
                "Requests ended by the server's request timeout.",
                [f"jaxtrain_request_timeouts_total {self.timeouts}"],
            )
            name = "jaxtrain_time_to_first_token_seconds"
            family(name, "histogram", "Arrival to first token.", self.ttft.lines(name))
            name = "jaxtrain_inter_token_latency_seconds"
            family(name, "histogram", "Between a sample's tokens.", self.itl.lines(name))
        return "\n".join(out) + "\n"


class RequestClock:
    """One request's token times, feeding `Metrics.token` (called on the engine's thread)."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first_seen = False
        self.previous: dict[int, float] = {}

    def token(self, index: int, now: float) -> None:
        first = None if self.first_seen else now - self.arrival
        self.first_seen = True
        before = self.previous.get(index)
        self.previous[index] = now
        self.metrics.token(first, None if before is None else now - before)

"""Prometheus metrics of one server, in a registry of its own (`/metrics` renders it in the text format).

Gauges that describe the scheduler's state (queue length, running rows) are read from it when scraped; the rest is
recorded by the scheduler as requests start, produce tokens and finish.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TokenRate:
    """Tokens per second over the last `window` seconds (thread-safe)."""

    def __init__(self, window: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window, self.clock = window, clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((self.clock(), tokens))
            self._trim()

    def rate(self) -> float:
        with self._lock:
            self._trim()
            return sum(n for _, n in self._events) / self.window

    def _trim(self) -> None:
        edge = self.clock() - self.window
        while self._events and self._events[0][0] < edge:
            self._events.popleft()


class Metrics:
    def __init__(self, queue_length: Callable[[], int], running_rows: Callable[[], int], max_batch: int):
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("sparsespec_queue_length", "Requests waiting for a slot", registry=r).set_function(queue_length)
        Gauge("sparsespec_running_rows", "Slots in use (prefilling or decoding)",
              registry=r).set_function(running_rows)
        Gauge("sparsespec_max_batch", "Slots of the decode batch", registry=r).set(max_batch)
        self._rate = TokenRate()
        Gauge("sparsespec_generation_tokens_per_second", "Generated tokens per second over the last 10 s",
              registry=r).set_function(self._rate.rate)
        self.requests = Counter("sparsespec_requests", "Finished requests by finish reason (stop, length, "
                                "cancelled, error)", ["finish_reason"], registry=r)
        self.rejected = Counter("sparsespec_rejected_requests", "Requests refused because the queue was full",
                                registry=r)
        self.prompt_tokens = Counter("sparsespec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("sparsespec_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("sparsespec_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("sparsespec_decode_step_seconds", "One batched decode step", buckets=_LATENCY_BUCKETS,
                              registry=r)

    def tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)
        self._rate.add(n)

    def render(self) -> tuple[bytes, str]:
        """-> (body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

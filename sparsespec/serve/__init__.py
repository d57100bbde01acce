"""`sparsespec serve`: an OpenAI-compatible HTTP server over one continuously batched decode runner.

    protocol.py   request models (pydantic) -> validated GenerationConfig; response and error objects
    scheduler.py  the continuous-batching loop: a thread owning the Runner's slots, a bounded queue in front
    metrics.py    Prometheus gauges, counters and histograms of one server
    app.py        the FastAPI app: endpoints, streaming (SSE), disconnects, shutdown
"""

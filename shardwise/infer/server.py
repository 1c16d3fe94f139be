"""`shardwise serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the engine.

Routes, registered by concern, each group in its module: POST /v1/completions and POST
/v1/chat/completions (`generation_routes.py`, with `stream: true` as server-sent events in
OpenAI's chunk format, ending `data: [DONE]`); GET /health, GET /metrics (Prometheus text) and
GET /v1/models (`status_routes.py`). Every request passes `http_guard.py` first (API key, body
size, per-route metrics; errors in OpenAI's JSON shape).

The engine steps in a thread other than the event loop's (`shardwise serve`: the main thread, which
built the model; uvicorn runs beside it); a request submits its sequences there and waits on an
asyncio queue that the engine thread fills (`jobs.py`). A client that goes away (mid-stream, or
while waiting for a whole answer) has its sequences cancelled: their slots are free at the
engine's next step. A request that would push more than `max_queue` sequences into the waiting
line is answered 429 at once.
"""

from __future__ import annotations

from fastapi import FastAPI

from shardwise.infer.generation_routes import add_generation_routes
from shardwise.infer.http_guard import add_body_limit, add_error_handlers, add_guard
from shardwise.infer.jobs import Admission
from shardwise.infer.metrics import ServerMetrics
from shardwise.infer.service import Service
from shardwise.infer.status_routes import add_status_routes


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="shardwise", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(service.engine)
    add_error_handlers(app)
    add_body_limit(app, service)  # inside the guard: its BaseHTTPMiddleware would wrap the refusal in a task group
    add_guard(app, service, metrics)
    add_status_routes(app, service, metrics)
    add_generation_routes(app, service, Admission(service.engine, metrics, max_queue=service.max_queue))
    return app

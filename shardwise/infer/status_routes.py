"""`shardwise serve`'s routes about the server itself: GET /health, GET /metrics (Prometheus text),
GET /v1/models."""

from __future__ import annotations

from fastapi.responses import JSONResponse, PlainTextResponse

from shardwise.infer.metrics import ServerMetrics
from shardwise.infer.service import Service


def add_status_routes(app, service: Service, metrics: ServerMetrics) -> None:
    engine = service.engine

    @app.get("/health")
    async def health():
        alive = engine.serving
        body = {"status": "ok" if alive else "engine stopped", "running": engine.num_running(),
                "waiting": engine.num_waiting()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "shardwise", "max_model_len": engine.context_len}]}

"""What every route of `shardwise serve` passes through: errors answered in OpenAI's JSON shape
(also FastAPI's own validation errors), the API key, the body size limit, and per-route counts
and latency."""

from __future__ import annotations

import time

from fastapi import Request  # at module level: FastAPI resolves the handlers' (string) annotations here
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from shardwise.infer.metrics import ServerMetrics
from shardwise.infer.protocol import OpenAIError
from shardwise.infer.service import Service


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def add_error_handlers(app) -> None:
    @app.exception_handler(OpenAIError)
    async def on_openai_error(request, err: OpenAIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return error_response(OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}"))
        message = f"{where or 'body'}: {first.get('msg')}" + (f" (got {first['input']!r})" if "input" in first and where else "")
        return error_response(OpenAIError(400, message, param=where))


def add_guard(app, service: Service, metrics: ServerMetrics) -> None:
    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Authorization, body size, and per-route counts and latency."""
        start = time.perf_counter()
        refusal = refused(request, service)
        if refusal is not None:
            return error_response(refusal)
        response = await call_next(request)
        metrics.observe_request(request.url.path, response.status_code, time.perf_counter() - start)
        return response


def refused(request: Request, service: Service) -> OpenAIError | None:
    """Why a request is answered before its route runs: a missing or wrong API key, a body too large."""
    if service.api_key and request.url.path.startswith("/v1/"):
        if request.headers.get("authorization") != f"Bearer {service.api_key}":
            return OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with the key "
                                    "given to --api-key", code="invalid_api_key", kind="authentication_error")
    length = request.headers.get("content-length")
    if length is not None and int(length) > service.max_body_bytes:
        return OpenAIError(400, f"the request body has {length} bytes, more than the {service.max_body_bytes} "
                                "this server accepts", code="request_too_large")
    return None

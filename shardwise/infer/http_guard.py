"""What every route of `shardwise serve` passes through: errors answered in OpenAI's JSON shape
(also FastAPI's own validation errors), the API key, the body size limit, and per-route counts
and latency."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import HTTPException, Request  # at module level: FastAPI resolves the handlers' (string) annotations here
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardwise.infer.metrics import ServerMetrics
from shardwise.infer.protocol import OpenAIError
from shardwise.infer.service import Service


LOG = logging.getLogger("shardwise.serve")
MAX_ECHOED_INPUT = 80  # characters of a rejected value quoted back in the error message


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def shortened(value) -> str:
    text = repr(value)
    return text if len(text) <= MAX_ECHOED_INPUT else text[:MAX_ECHOED_INPUT] + "..."


def add_error_handlers(app) -> None:
    @app.exception_handler(OpenAIError)
    async def on_openai_error(request, err: OpenAIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, err: StarletteHTTPException):
        """Starlette's own answers (an unknown route, a wrong method, a body that is not UTF-8) in OpenAI's shape."""
        if isinstance(err, BodyTooLarge):
            return error_response(err.error)
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        response = error_response(OpenAIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                              kind=kind))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request, err: RequestValidationError):
        first = err.errors()[0]
        loc = first.get("loc", ())[1:]
        where = ".".join(str(part) for part in loc) or None
        if first.get("type") == "json_invalid":
            return error_response(OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}"))
        message = f"{where or 'body'}: {first.get('msg')}" + (f" (got {shortened(first['input'])})"
                                                              if "input" in first and where else "")
        return error_response(OpenAIError(400, message, param=str(loc[0]) if loc else None))

    @app.exception_handler(Exception)
    async def on_bug(request, err: Exception):
        """Any other exception is a bug of the server's: a 500 whose id the log line carries too."""
        error_id = uuid.uuid4().hex[:12]
        LOG.error("shardwise: error: %s %s failed (error id %s): %s: %s", request.method, request.url.path, error_id,
                  type(err).__name__, err, exc_info=err)
        return error_response(OpenAIError(500, f"the server failed on this request (error id {error_id}; the server "
                                                "log has its traceback under that id)", code="internal_error",
                                          kind="server_error"))


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


def too_large(size: str | int, service: Service) -> OpenAIError:
    return OpenAIError(400, f"the request body has {size} bytes, more than the {service.max_body_bytes} this "
                            "server accepts", code="request_too_large")


class BodyTooLarge(HTTPException):
    """Raised while a body without a Content-Length header is read past the limit. FastAPI's own
    HTTPException, because FastAPI turns any other exception raised while it parses a body into
    "There was an error parsing the body"; `on_http_error` answers it."""

    def __init__(self, error: OpenAIError):
        super().__init__(error.status, str(error))
        self.error = error


def add_body_limit(app, service: Service) -> None:
    """Count the bytes of every body as they arrive: a chunked upload has no Content-Length for
    `refused` to check, and would otherwise be read whole into memory."""

    def limit(inner):
        async def app_with_limit(scope, receive, send):
            if scope["type"] != "http":
                return await inner(scope, receive, send)
            received = 0

            async def receive_within_limit():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > service.max_body_bytes:
                        raise BodyTooLarge(too_large(f"more than {received}", service))
                return message

            await inner(scope, receive_within_limit, send)

        return app_with_limit

    app.add_middleware(limit)


def refused(request: Request, service: Service) -> OpenAIError | None:
    """Why a request is answered before its route runs: a missing or wrong API key, a body too large."""
    if service.api_key and request.url.path.startswith("/v1/"):
        if request.headers.get("authorization") != f"Bearer {service.api_key}":
            return OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with the key "
                                    "given to --api-key", code="invalid_api_key", kind="authentication_error")
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        return OpenAIError(400, f"the Content-Length header {length!r} is not a byte count", code="bad_content_length")
    if length is not None and int(length) > service.max_body_bytes:
        return too_large(length, service)
    return None
